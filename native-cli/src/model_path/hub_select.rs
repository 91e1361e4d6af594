//! What `hf:ORG/REPO[:SELECTOR]` means among a hub repo's files: one GGUF
//! file, picked by quantization name or file name as llama.cpp's `-hf`
//! does, or a safetensors repo taken whole.

use anyhow::{bail, Result};

/// llama.cpp's pick when a repo has several GGUF files and no selector.
const DEFAULT_QUANT: &str = "Q4_K_M";
const CONFIG_FILE: &str = "config.json";
const SINGLE_WEIGHTS: &str = "model.safetensors";
const WEIGHTS_INDEX: &str = "model.safetensors.index.json";
/// Tokenizer and generation files a Hugging Face directory may carry.
const COMPANION_FILES: [&str; 5] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
];
/// How many file names an error lists before it says how many more there are.
const LISTED_FILES: usize = 20;

/// A parsed `ORG/REPO[:SELECTOR]`.
#[derive(Clone, Debug, PartialEq)]
pub struct HubSpec {
    pub repo: String,
    /// A quantization name (`Q4_K_M`) or a file name, matched case-insensitively.
    pub selector: Option<String>,
}

/// The files to download.
#[derive(Clone, Debug, PartialEq)]
pub enum Selection {
    Gguf(String),
    /// A safetensors checkpoint: `files` (config, tokenizer files and, when
    /// `indexed`, the index), then the shards the index names, or the
    /// single `model.safetensors`.
    HfDir {
        files: Vec<String>,
        indexed: bool,
    },
}

impl HubSpec {
    pub fn parse(spec: &str) -> Result<Self> {
        let (repo, selector) = match spec.split_once(':') {
            Some((repo, selector)) => (repo, Some(selector)),
            None => (spec, None),
        };
        let valid_part = |p: &str| {
            !p.is_empty()
                && p != "."
                && p != ".."
                && p.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        };
        match repo.split_once('/') {
            Some((org, name)) if valid_part(org) && valid_part(name) => {}
            _ => bail!("'hf:{spec}' is not hf:ORG/REPO[:QUANT_OR_FILE]"),
        }
        if selector.is_some_and(|s| s.is_empty() || s.contains("..")) {
            bail!("'hf:{spec}' has an empty or invalid file or quantization after ':'");
        }
        Ok(Self {
            repo: repo.to_string(),
            selector: selector.map(str::to_string),
        })
    }
}

/// Picks the files of `spec` among the repo's `files` (paths in the repo).
pub fn select(spec: &HubSpec, files: &[String]) -> Result<Selection> {
    let repo = &spec.repo;
    let ggufs: Vec<&String> = files
        .iter()
        .filter(|f| {
            let name = f.rsplit('/').next().unwrap_or(f).to_ascii_lowercase();
            // Multimodal projectors are not language models.
            name.ends_with(".gguf") && !name.starts_with("mmproj")
        })
        .collect();
    if let Some(selector) = &spec.selector {
        if let Some(file) = files.iter().find(|f| f.eq_ignore_ascii_case(selector)) {
            if !ggufs.contains(&file) {
                bail!(
                    "{file} of {repo} is not a GGUF model file; a safetensors repo is \
                     taken whole: hf:{repo}"
                );
            }
            return Ok(Selection::Gguf(file.clone()));
        }
        let wanted = selector.to_ascii_lowercase();
        let matches: Vec<&String> = ggufs
            .iter()
            .copied()
            .filter(|f| f.to_ascii_lowercase().contains(&wanted))
            .collect();
        return match matches[..] {
            [one] => Ok(Selection::Gguf(one.clone())),
            [] if ggufs.is_empty() => bail!(
                "{repo} has no GGUF files, so nothing matches '{selector}'; its files: {}",
                listing(files.iter())
            ),
            [] => bail!(
                "no GGUF file of {repo} matches '{selector}'; its GGUF files: {}",
                listing(ggufs.iter().copied())
            ),
            _ => bail!(
                "'{selector}' matches several GGUF files of {repo}: {}; name one of them",
                listing(matches.iter().copied())
            ),
        };
    }
    if !ggufs.is_empty() {
        let defaults: Vec<&String> = ggufs
            .iter()
            .copied()
            .filter(|f| f.to_ascii_uppercase().contains(DEFAULT_QUANT))
            .collect();
        return match (&ggufs[..], &defaults[..]) {
            ([one], _) | (_, [one]) => Ok(Selection::Gguf((*one).clone())),
            _ => bail!(
                "{repo} has several GGUF files; pick one with hf:{repo}:QUANT \
                 (or :FILE): {}",
                listing(ggufs.iter().copied())
            ),
        };
    }
    let has = |name: &str| files.iter().any(|f| f == name);
    let indexed = has(WEIGHTS_INDEX);
    if !has(CONFIG_FILE) || !(indexed || has(SINGLE_WEIGHTS)) {
        bail!(
            "{repo} has neither GGUF files nor {CONFIG_FILE} with {SINGLE_WEIGHTS} \
             (or {WEIGHTS_INDEX}); its files: {}",
            listing(files.iter())
        );
    }
    let mut wanted = vec![CONFIG_FILE.to_string()];
    wanted.extend(
        COMPANION_FILES
            .iter()
            .filter(|f| has(f))
            .map(|f| f.to_string()),
    );
    wanted.push(
        if indexed {
            WEIGHTS_INDEX
        } else {
            SINGLE_WEIGHTS
        }
        .to_string(),
    );
    Ok(Selection::HfDir {
        files: wanted,
        indexed,
    })
}

/// The shard files an index's `weight_map` names, each once, sorted.
pub fn index_shards(index_json: &str) -> Result<Vec<String>> {
    let index: serde_json::Value = serde_json::from_str(index_json)
        .map_err(|e| anyhow::anyhow!("{WEIGHTS_INDEX} is not JSON: {e}"))?;
    let Some(map) = index.get("weight_map").and_then(|m| m.as_object()) else {
        bail!("{WEIGHTS_INDEX} has no weight_map object");
    };
    let mut shards = Vec::new();
    for (tensor, file) in map {
        match file.as_str() {
            // As the loader wants it: a file beside the index.
            Some(f) if !f.is_empty() && f != ".." && !f.contains(['/', '\\']) => {
                shards.push(f.to_string())
            }
            _ => bail!("{WEIGHTS_INDEX} maps {tensor} to {file}, not a file of the repo"),
        }
    }
    shards.sort();
    shards.dedup();
    Ok(shards)
}

fn listing<'a>(files: impl Iterator<Item = &'a String>) -> String {
    let files: Vec<&String> = files.collect();
    if files.is_empty() {
        return "none".to_string();
    }
    let mut text: Vec<&str> = files
        .iter()
        .take(LISTED_FILES)
        .map(|f| f.as_str())
        .collect();
    let more = files.len().saturating_sub(LISTED_FILES);
    let more_text = format!("and {more} more");
    if more > 0 {
        text.push(&more_text);
    }
    text.join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(s: &str) -> HubSpec {
        HubSpec::parse(s).unwrap()
    }

    fn names(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    const GGUF_REPO: [&str; 6] = [
        ".gitattributes",
        "README.md",
        "qwen2.5-0.5b-instruct-q4_k_m.gguf",
        "qwen2.5-0.5b-instruct-q5_k_m.gguf",
        "qwen2.5-0.5b-instruct-q8_0.gguf",
        "mmproj-qwen-f16.gguf",
    ];

    #[test]
    fn parses_repo_and_selector() {
        assert_eq!(spec("Qwen/Qwen2.5-0.5B-Instruct-GGUF").selector, None);
        let s = spec("Qwen/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M");
        assert_eq!(s.repo, "Qwen/Qwen2.5-0.5B-Instruct-GGUF");
        assert_eq!(s.selector.as_deref(), Some("Q4_K_M"));
        for bad in ["Qwen", "/x", "a/b/c", "a/..", "a/b:", "a/b:../x", "a b/c"] {
            assert!(HubSpec::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn quantization_names_match_case_insensitively() {
        let files = names(&GGUF_REPO);
        for (selector, want) in [
            ("Q4_K_M", "qwen2.5-0.5b-instruct-q4_k_m.gguf"),
            ("q8_0", "qwen2.5-0.5b-instruct-q8_0.gguf"),
            (
                "QWEN2.5-0.5B-INSTRUCT-Q5_K_M.GGUF",
                "qwen2.5-0.5b-instruct-q5_k_m.gguf",
            ),
        ] {
            let s = spec(&format!("Qwen/R:{selector}"));
            assert_eq!(select(&s, &files).unwrap(), Selection::Gguf(want.into()));
        }
    }

    #[test]
    fn without_a_selector_the_only_gguf_or_q4_k_m() {
        let files = names(&GGUF_REPO);
        assert_eq!(
            select(&spec("Qwen/R"), &files).unwrap(),
            Selection::Gguf("qwen2.5-0.5b-instruct-q4_k_m.gguf".into())
        );
        let two = names(&["a-Q8_0.gguf", "a-Q6_K.gguf"]);
        let e = select(&spec("o/r"), &two).unwrap_err().to_string();
        assert!(e.contains("several") && e.contains("a-Q6_K.gguf"), "{e}");
        let one = names(&["a-Q8_0.gguf", "mmproj-a.gguf"]);
        assert_eq!(
            select(&spec("o/r"), &one).unwrap(),
            Selection::Gguf("a-Q8_0.gguf".into())
        );
    }

    #[test]
    fn ambiguous_missing_and_non_gguf_selectors_list_the_files() {
        let files = names(&GGUF_REPO);
        let e = select(&spec("Qwen/R:K_M"), &files).unwrap_err().to_string();
        assert!(e.contains("several") && e.contains("q4_k_m") && e.contains("q5_k_m"));
        assert!(!e.contains("q8_0"), "{e}");
        let e = select(&spec("Qwen/R:IQ2_XS"), &files)
            .unwrap_err()
            .to_string();
        assert!(e.contains("IQ2_XS") && e.contains("q8_0.gguf"), "{e}");
        assert!(!e.contains("mmproj") && !e.contains("README"), "{e}");
        let e = select(&spec("Qwen/R:README.md"), &files)
            .unwrap_err()
            .to_string();
        assert!(e.contains("not a GGUF"), "{e}");
    }

    #[test]
    fn safetensors_repos_are_taken_whole() {
        let files = names(&[
            "config.json",
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
            WEIGHTS_INDEX,
            "tokenizer.json",
            "tokenizer_config.json",
            "onnx/model.onnx",
        ]);
        assert_eq!(
            select(&spec("o/r"), &files).unwrap(),
            Selection::HfDir {
                files: names(&[
                    "config.json",
                    "tokenizer.json",
                    "tokenizer_config.json",
                    WEIGHTS_INDEX
                ]),
                indexed: true,
            }
        );
        let single = names(&["config.json", "model.safetensors", "tokenizer.json"]);
        assert_eq!(
            select(&spec("o/r"), &single).unwrap(),
            Selection::HfDir {
                files: names(&["config.json", "tokenizer.json", "model.safetensors"]),
                indexed: false,
            }
        );
        let e = select(&spec("o/r"), &names(&["README.md"]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("neither GGUF") && e.contains("README.md"), "{e}");
        let e = select(&spec("o/r:Q4_K_M"), &single)
            .unwrap_err()
            .to_string();
        assert!(e.contains("no GGUF files"), "{e}");
    }

    #[test]
    fn index_shards_are_unique_and_checked() {
        let index = r#"{"metadata": {}, "weight_map": {"a": "m-2.safetensors",
            "b": "m-1.safetensors", "c": "m-2.safetensors"}}"#;
        assert_eq!(
            index_shards(index).unwrap(),
            ["m-1.safetensors", "m-2.safetensors"]
        );
        assert!(index_shards(r#"{"weight_map": {"a": "../../etc/passwd"}}"#).is_err());
        assert!(index_shards(r#"{"weight_map": {"a": 3}}"#).is_err());
        assert!(index_shards("{}").is_err());
    }
}
