//! The table against the kernels, on any machine: every entry point the
//! backend may launch is an `extern "C" __global__` function of the unit it
//! is loaded from (the file whole, or its unit for one weight format, as
//! `KernelSet::module` builds them), and takes the parameters the table
//! gives it, in count, order and kind (a pointer, `int`, `u32`, `u64`,
//! `float`, or a struct by value of the Rust mirror's size).
//!
//! Which entry points a signature may launch comes from the functions the
//! launch code picks them with (`matmul_variant`, `mlp_variant`,
//! `kv_variant`, `half_type`), run over every weight format and a range of
//! shapes.

use std::collections::{BTreeMap, BTreeSet};

use tandem_core::backend::KvDtype;
use tandem_core::quant::WeightFormat;

use super::preprocess::{self, Unit};
use super::{File, Kind, Resolved, Signature, Which, SIGNATURES};
use crate::backend::{half_type, kv_variant, matmul_variant, mlp_variant};
use crate::sources;

/// The variants `matmul_variant` picks for `format`, over token counts
/// from decode to prefill and rows aligned or not.
fn matmul_variants(format: WeightFormat) -> BTreeSet<String> {
    let aligned = format.block_elems() * 8;
    let mut variants = BTreeSet::new();
    for rows in (1..=9).chain([16, 64, 130]) {
        for cols in [aligned, 45] {
            if cols % format.block_elems() == 0 {
                variants.insert(matmul_variant(format, 101, cols, rows).unwrap().0);
            }
        }
    }
    variants
}

/// The variants `mlp_variant` picks for weights in `format`.
fn mlp_variants(format: WeightFormat) -> BTreeSet<String> {
    (1..=9)
        .filter_map(|rows| mlp_variant([format; 2], 256, 512, rows))
        .map(|(variant, _)| variant)
        .collect()
}

fn kv_variants() -> BTreeSet<String> {
    [KvDtype::F32, KvDtype::F16, KvDtype::Int8, KvDtype::Int4]
        .into_iter()
        .map(|d| kv_variant(d).to_string())
        .collect()
}

/// Every format and variant `sig` may be launched with.
fn launches(sig: &Signature) -> Vec<(Option<WeightFormat>, Option<String>)> {
    let takes_format = !matches!(sig.file, File::Whole(_)) || sig.entry.contains("{stem}");
    let formats: Vec<Option<WeightFormat>> = if !takes_format {
        vec![None]
    } else if sig.name.ends_with("add_bias") || sig.name == "matmul_glu_gate" {
        // The cuBLAS paths' epilogues: dense F16 and BF16 only.
        WeightFormat::ALL
            .into_iter()
            .filter(|f| half_type(*f).is_some())
            .map(Some)
            .collect()
    } else {
        // Per-format units hold the file's other kernels too: every unit
        // must have them, whichever the launch picks.
        WeightFormat::ALL.into_iter().map(Some).collect()
    };
    let mut out = Vec::new();
    for format in formats {
        if !sig.entry.contains("{variant}") {
            out.push((format, None));
            continue;
        }
        let variants = match (sig.name, format) {
            ("matmul" | "matmul_rms_norm" | "matmul_glu" | "matmul_residual", Some(f)) => {
                matmul_variants(f)
            }
            ("mlp_residual", Some(f)) => mlp_variants(f),
            (
                "paged_kv_write"
                | "paged_attention_decode"
                | "paged_attention_prefill"
                | "paged_attention_scores",
                None,
            ) => kv_variants(),
            _ => panic!(
                "signature {}: which {{variant}}s does it launch? Teach `launches` the \
                 function its launch site picks them with",
                sig.name
            ),
        };
        out.extend(variants.into_iter().map(|v| (format, Some(v))));
    }
    out
}

/// Parsed units, by file and format stem.
#[derive(Default)]
struct Units(BTreeMap<(String, Option<String>), Result<Unit, String>>);

impl Units {
    fn get(&mut self, file: &str, stem: Option<&str>) -> &Result<Unit, String> {
        let key = (file.to_string(), stem.map(str::to_string));
        self.0.entry(key).or_insert_with(|| {
            let kernel_file = sources::kernel_file(file)
                .ok_or_else(|| format!("no kernel file kernels/{file}.cu"))?;
            let unit = match stem {
                Some(stem) => sources::format_unit(file, kernel_file.source, stem),
                None => sources::translation_unit(file, kernel_file.source),
            };
            preprocess::kernels(&unit).map_err(|e| format!("kernels/{file}.cu: {e}"))
        })
    }
}

fn kinds(args: &[Kind]) -> String {
    let names: Vec<String> = args
        .iter()
        .map(|k| match k {
            Kind::Ptr => "ptr".to_string(),
            Kind::I32 => "i32".to_string(),
            Kind::U32 => "u32".to_string(),
            Kind::U64 => "u64".to_string(),
            Kind::F32 => "f32".to_string(),
            Kind::Struct { name, bytes } => format!("{name} ({bytes} bytes)"),
        })
        .collect();
    format!("({})", names.join(", "))
}

/// Every mismatch between the table and the kernels, one line each.
fn mismatches(table: &[Signature]) -> (Vec<String>, usize) {
    let mut units = Units::default();
    let mut problems = Vec::new();
    let mut checked = 0;
    for sig in table {
        let launches = launches(sig);
        if launches.is_empty() {
            problems.push(format!("{}: launched with nothing", sig.name));
        }
        for (format, variant) in launches {
            let which = Which {
                format,
                variant: variant.as_deref(),
            };
            let Resolved { file, unit, entry } = match sig.resolve(which) {
                Ok(resolved) => resolved,
                Err(e) => {
                    problems.push(e.to_string());
                    continue;
                }
            };
            let place = match unit {
                Some(stem) => format!("kernels/{file}.cu (unit {stem})"),
                None => format!("kernels/{file}.cu"),
            };
            checked += 1;
            match units.get(file, unit) {
                Err(e) => problems.push(e.clone()),
                Ok(parsed) => match parsed.kernels.get(&entry) {
                    None => problems.push(format!(
                        "{}: {place} declares no extern \"C\" __global__ {entry}",
                        sig.name
                    )),
                    Some(declared) if declared.as_slice() != sig.args => problems.push(format!(
                        "{}: {entry} takes {} in {place}, the launch pushes {}",
                        sig.name,
                        kinds(declared),
                        kinds(sig.args)
                    )),
                    Some(_) => {}
                },
            }
        }
    }
    problems.sort();
    problems.dedup();
    (problems, checked)
}

#[test]
fn every_launch_matches_a_kernel_declaration() {
    let (problems, checked) = mismatches(SIGNATURES);
    assert!(
        problems.is_empty(),
        "the launch table (backend-cuda/src/signatures.rs) and kernels/*.cu disagree:\n  {}",
        problems.join("\n  ")
    );
    // Every format's matmul variants and units were reached.
    assert!(checked > 18 * 6 * 4, "only {checked} entry points checked");
}

#[test]
fn a_wrong_name_count_or_kind_is_found() {
    // matmul_residual takes (w, x, out: pointers; tokens, n, cols: u32).
    const ONE_SHORT: &[Kind] = &[Kind::Ptr, Kind::Ptr, Kind::Ptr, Kind::U32, Kind::U32];
    const AN_I32: &[Kind] = &[
        Kind::Ptr,
        Kind::Ptr,
        Kind::Ptr,
        Kind::U32,
        Kind::I32,
        Kind::U32,
    ];
    let base = &super::MATMUL_RESIDUAL;
    let variant = |entry, args| Signature {
        name: base.name,
        file: base.file,
        entry,
        args,
    };
    let cases = [
        variant("matmul_residual_{stem}_{variant}x", base.args),
        variant(base.entry, ONE_SHORT),
        variant(base.entry, AN_I32),
    ];
    for (sig, expected) in cases.iter().zip(["declares no", "takes", "takes"]) {
        let (problems, _) = mismatches(std::slice::from_ref(sig));
        assert!(
            !problems.is_empty() && problems.iter().all(|p| p.contains(expected)),
            "{}: {problems:?}",
            sig.entry
        );
    }
    // A struct of another size than the kernels' (the mirror before
    // `head_tables`).
    let shape = Kind::Struct {
        name: "AttentionShape",
        bytes: 32,
    };
    let base = &super::PAGED_ATTENTION_PREFILL;
    let mut args = base.args.to_vec();
    for a in args.iter_mut() {
        if matches!(a, Kind::Struct { .. }) {
            *a = shape;
        }
    }
    let sig = Signature {
        name: base.name,
        file: base.file,
        entry: base.entry,
        args: Box::leak(args.into_boxed_slice()),
    };
    let (problems, _) = mismatches(std::slice::from_ref(&sig));
    assert!(
        problems
            .iter()
            .any(|p| p.contains("AttentionShape (36 bytes)")),
        "{problems:?}"
    );
}

#[test]
fn every_kernel_is_launched_and_loadable_by_name() {
    let mut units = Units::default();
    let mut launched = BTreeSet::new();
    for sig in SIGNATURES {
        for (format, variant) in launches(sig) {
            let which = Which {
                format,
                variant: variant.as_deref(),
            };
            let resolved = sig.resolve(which).unwrap();
            launched.insert((resolved.file, resolved.entry));
        }
    }
    let mut problems = Vec::new();
    for file in sources::KERNEL_FILES {
        let stems: Vec<Option<&str>> = if sources::PER_FORMAT_FILES.contains(&file.name) {
            WeightFormat::ALL
                .into_iter()
                .map(|f| Some(crate::backend::format_stem(f)))
                .collect()
        } else {
            vec![None]
        };
        for stem in stems {
            let unit = match units.get(file.name, stem) {
                Ok(unit) => unit,
                Err(e) => {
                    problems.push(e.clone());
                    continue;
                }
            };
            for name in &unit.mangled {
                problems.push(format!(
                    "kernels/{}.cu: __global__ {name} is not extern \"C\" (the backend \
                     loads kernels by name)",
                    file.name
                ));
            }
            for name in unit.kernels.keys() {
                if !launched.contains(&(file.name, name.clone())) {
                    problems.push(format!(
                        "kernels/{}.cu{}: {name} is launched by no row of the table",
                        file.name,
                        stem.map(|s| format!(" (unit {s})")).unwrap_or_default()
                    ));
                }
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn which_must_name_what_the_signature_takes() {
    let q4 = WeightFormat::Q4_K;
    let resolved = super::MATMUL
        .resolve(Which::format_variant(q4, "gemv_t1"))
        .unwrap();
    assert_eq!(
        (resolved.file, resolved.unit, resolved.entry.as_str()),
        ("matmul_q4_k", None, "matmul_q4_k_gemv_t1")
    );
    let resolved = super::MATMUL_GLU_GATE
        .resolve(Which::format(WeightFormat::BF16))
        .unwrap();
    assert_eq!(
        (resolved.file, resolved.unit, resolved.entry.as_str()),
        ("matmul_glu", Some("bf16"), "matmul_glu_gate")
    );
    assert!(super::MATMUL.resolve(Which::format(q4)).is_err());
    assert!(super::EMBEDDING.resolve(Which::format(q4)).is_err());
    assert!(super::PAGED_KV_WRITE.resolve(Which::ONE).is_err());
}
