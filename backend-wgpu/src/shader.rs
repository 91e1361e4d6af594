//! The shader generator: the WGSL text of one kernel variant, built from the
//! single source of each kernel in `shaders/`.
//!
//! A variant is the kernel's file, preceded by the prelude (`wgsl/prelude.wgsl`:
//! invocation ids and workgroup reductions) and, for the kernels that read
//! weights, by the weight format's decoder (`shaders/matmul_FORMAT.wgsl`);
//! the matmul entry points themselves live in `wgsl/matmul.wgsl` (W8A8's
//! integer ones in its own file) over `wgsl/matmul_common.wgsl`. The fused
//! matmuls (`matmul_rms_norm`, `matmul_glu`, `matmul_residual`) are those
//! same entry points with the flags of [`FUSED_MATMULS`], which select the
//! norm prologue and the pairing of gate and up rows, and with the
//! kernel's own file, which supplies the epilogue (`emit`). Lines
//! `// #if FLAG`, `// #if !FLAG`, `// #else`, `// #endif` select the text of a
//! variant. The `enable` directives that must open a module are written here,
//! because native (naga) and browser WGSL differ there: naga rejects
//! `enable subgroups;`, which Chrome requires.

use tandem_core::quant::{Int4Group, WeightFormat};

/// What the target device and WGSL dialect allow.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ShaderTarget {
    /// `enable f16;` and `f16` storage (the adapter has `shader-f16`).
    pub f16: bool,
    /// Subgroup reductions (the adapter has `subgroups`).
    pub subgroups: bool,
    /// Browser WGSL: subgroup operations need `enable subgroups;`.
    pub browser: bool,
}

/// One compiled form of a manifest kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ShaderVariant {
    /// Manifest name; `matmul` variants name the format's entry (`matmul_q4_0`).
    pub kernel: &'static str,
    /// Weight format of `embedding` and `matmul_*` (which the name implies,
    /// but for INT4's group size).
    pub format: Option<WeightFormat>,
    /// F16 KV cache (`paged_kv_write`, `paged_attention`).
    pub kv_f16: bool,
}

const PRELUDE: &str = include_str!("wgsl/prelude.wgsl");
const MATMUL_ENTRY_POINTS: &str = include_str!("wgsl/matmul.wgsl");
/// Bindings, the norm prologue and the plain epilogue of every matmul's entry points.
const MATMUL_COMMON: &str = include_str!("wgsl/matmul_common.wgsl");
/// The attention algorithm; `paged_attention*.wgsl` supply the cache readers.
const ATTENTION_ENTRY_POINTS: &str = include_str!("wgsl/attention.wgsl");
/// The attention-score variant (KV eviction): kernel names ending in this
/// suffix are the attention entry's cache readers with `wgsl/attention_scores.wgsl`.
const SCORES_SUFFIX: &str = "_scores";
const SCORES_ENTRY_POINTS: &str = include_str!("wgsl/attention_scores.wgsl");

/// The source of each manifest entry, `shaders/NAME.wgsl`.
const SOURCES: &[(&str, &str)] = &[
    ("embedding", include_str!("../../shaders/embedding.wgsl")),
    ("rms_norm", include_str!("../../shaders/rms_norm.wgsl")),
    (
        "rms_norm_residual",
        include_str!("../../shaders/rms_norm_residual.wgsl"),
    ),
    ("matmul_f32", include_str!("../../shaders/matmul_f32.wgsl")),
    ("matmul_f16", include_str!("../../shaders/matmul_f16.wgsl")),
    (
        "matmul_bf16",
        include_str!("../../shaders/matmul_bf16.wgsl"),
    ),
    (
        "matmul_q8_0",
        include_str!("../../shaders/matmul_q8_0.wgsl"),
    ),
    (
        "matmul_q4_0",
        include_str!("../../shaders/matmul_q4_0.wgsl"),
    ),
    (
        "matmul_q4_1",
        include_str!("../../shaders/matmul_q4_1.wgsl"),
    ),
    (
        "matmul_int8",
        include_str!("../../shaders/matmul_int8.wgsl"),
    ),
    (
        "matmul_w8a8",
        include_str!("../../shaders/matmul_w8a8.wgsl"),
    ),
    (
        "matmul_int4",
        include_str!("../../shaders/matmul_int4.wgsl"),
    ),
    (
        "matmul_q5_0",
        include_str!("../../shaders/matmul_q5_0.wgsl"),
    ),
    (
        "matmul_q5_1",
        include_str!("../../shaders/matmul_q5_1.wgsl"),
    ),
    (
        "matmul_iq4_nl",
        include_str!("../../shaders/matmul_iq4_nl.wgsl"),
    ),
    (
        "matmul_q2_k",
        include_str!("../../shaders/matmul_q2_k.wgsl"),
    ),
    (
        "matmul_q3_k",
        include_str!("../../shaders/matmul_q3_k.wgsl"),
    ),
    (
        "matmul_q4_k",
        include_str!("../../shaders/matmul_q4_k.wgsl"),
    ),
    (
        "matmul_q5_k",
        include_str!("../../shaders/matmul_q5_k.wgsl"),
    ),
    (
        "matmul_q6_k",
        include_str!("../../shaders/matmul_q6_k.wgsl"),
    ),
    ("rope", include_str!("../../shaders/rope.wgsl")),
    (
        "paged_kv_write",
        include_str!("../../shaders/paged_kv_write.wgsl"),
    ),
    (
        "paged_attention",
        include_str!("../../shaders/paged_attention.wgsl"),
    ),
    (
        "paged_kv_write_quant",
        include_str!("../../shaders/paged_kv_write_quant.wgsl"),
    ),
    (
        "paged_attention_quant",
        include_str!("../../shaders/paged_attention_quant.wgsl"),
    ),
    (
        "paged_kv_write_int4_keys",
        include_str!("../../shaders/paged_kv_write_int4_keys.wgsl"),
    ),
    ("swiglu", include_str!("../../shaders/swiglu.wgsl")),
    ("geglu", include_str!("../../shaders/geglu.wgsl")),
    ("scale", include_str!("../../shaders/scale.wgsl")),
    (
        "gather_rows",
        include_str!("../../shaders/gather_rows.wgsl"),
    ),
    ("moe_route", include_str!("../../shaders/moe_route.wgsl")),
    (
        "moe_combine",
        include_str!("../../shaders/moe_combine.wgsl"),
    ),
    ("argmax", include_str!("../../shaders/argmax.wgsl")),
    (
        "kv_key_bounds",
        include_str!("../../shaders/kv_key_bounds.wgsl"),
    ),
    (
        "select_kv_blocks",
        include_str!("../../shaders/select_kv_blocks.wgsl"),
    ),
    (
        "matmul_rms_norm",
        include_str!("../../shaders/matmul_rms_norm.wgsl"),
    ),
    ("matmul_glu", include_str!("../../shaders/matmul_glu.wgsl")),
    (
        "matmul_residual",
        include_str!("../../shaders/matmul_residual.wgsl"),
    ),
];

/// The fused matmuls and the flags that shape the shared matmul entry
/// points for each: `FUSED` (the kernel's file defines the epilogue), `NORM`
/// (the RMSNorm prologue), `SPLIT` (three outputs), `GLU` (gate and up rows
/// in pairs). Their variants name the weight format.
const FUSED_MATMULS: [(&str, &[&str]); 3] = [
    ("matmul_rms_norm", &["FUSED", "NORM", "SPLIT"]),
    ("matmul_glu", &["FUSED", "NORM", "GLU"]),
    ("matmul_residual", &["FUSED"]),
];

/// The text of `shaders/NAME.wgsl`, if the manifest entry has one.
pub fn kernel_source(name: &str) -> Option<&'static str> {
    SOURCES.iter().find(|(n, _)| *n == name).map(|(_, s)| *s)
}

/// The complete WGSL module of `variant` for `target`.
pub fn generate(variant: &ShaderVariant, target: &ShaderTarget) -> Result<String, String> {
    let missing = || format!("no WGSL source for kernel `{}`", variant.kernel);
    let mut parts = vec![PRELUDE];
    let mut flags = Vec::new();
    let fused = FUSED_MATMULS
        .iter()
        .find(|(name, _)| *name == variant.kernel)
        .map(|(_, flags)| *flags);
    if fused.is_some() || variant.kernel.starts_with("matmul_") {
        // A plain matmul's file is its format's decoder (but for W8A8); a
        // fused one's is its epilogue, and the variant names the format.
        let (decoder, w8a8) = match (fused, variant.format) {
            (Some(_), Some(format)) => (decoder_of(format), format == WeightFormat::W8A8),
            (Some(_), None) => return Err(format!("`{}` needs a weight format", variant.kernel)),
            (None, _) if variant.kernel == W8A8_KERNEL => (decoder_of(WeightFormat::W8A8), true),
            (None, _) => (variant.kernel, false),
        };
        parts.push(kernel_source(decoder).ok_or_else(missing)?);
        parts.push(MATMUL_COMMON);
        if fused.is_some() {
            parts.push(kernel_source(variant.kernel).ok_or_else(missing)?);
        }
        parts.push(match w8a8 {
            true => kernel_source(W8A8_KERNEL).ok_or_else(missing)?,
            false => MATMUL_ENTRY_POINTS,
        });
        flags.extend_from_slice(fused.unwrap_or_default());
    } else if let Some(entry) = variant.kernel.strip_suffix(SCORES_SUFFIX) {
        parts.push(kernel_source(entry).ok_or_else(missing)?);
        parts.push(SCORES_ENTRY_POINTS);
    } else if variant.kernel.starts_with("paged_attention") {
        parts.push(kernel_source(variant.kernel).ok_or_else(missing)?);
        parts.push(ATTENTION_ENTRY_POINTS);
    } else {
        if let Some(format) = variant.format {
            parts.push(kernel_source(decoder_of(format)).ok_or_else(missing)?);
        }
        parts.push(kernel_source(variant.kernel).ok_or_else(missing)?);
    }

    if target.f16 {
        flags.push("F16");
    }
    if target.subgroups {
        flags.push("SUBGROUPS");
    }
    if variant.kv_f16 {
        flags.push("KV_F16");
    }
    if variant.format
        == Some(WeightFormat::Int4 {
            group: Int4Group::G128,
        })
    {
        flags.push("INT4_G128");
    }

    let mut text = String::new();
    if target.f16 {
        text.push_str("enable f16;\n");
    }
    if target.subgroups && target.browser {
        text.push_str("enable subgroups;\n");
    }
    for part in parts {
        text.push_str(&preprocess(part, &flags)?);
        text.push('\n');
    }
    Ok(text)
}

/// The matmul entry whose own entry points replace `wgsl/matmul.wgsl`.
const W8A8_KERNEL: &str = "matmul_w8a8";

/// The file with `format`'s `decode4`: its matmul entry's, except for W8A8,
/// whose bytes and decoder are INT8's.
fn decoder_of(format: WeightFormat) -> &'static str {
    let decoded_as = match format {
        WeightFormat::W8A8 => WeightFormat::Int8PerChannel,
        other => other,
    };
    tandem_core::kernels::matmul_kernel_name(decoded_as)
}

/// Keeps the lines whose enclosing `// #if` conditions hold for `flags`.
/// Directive lines become empty lines so that line numbers in compiler
/// messages still match the source file.
pub fn preprocess(source: &str, flags: &[&str]) -> Result<String, String> {
    // One entry per open `#if`: (its condition holds, we are in its `#else`).
    let mut open: Vec<(bool, bool)> = Vec::new();
    let mut out = String::with_capacity(source.len());
    for (number, line) in source.lines().enumerate() {
        let directive = line.trim().strip_prefix("// #").map(str::trim);
        match directive {
            Some(d) if d.starts_with("if ") => {
                let cond = d["if ".len()..].trim();
                let holds = match cond.strip_prefix('!') {
                    Some(flag) => !flags.contains(&flag.trim()),
                    None => flags.contains(&cond),
                };
                open.push((holds, false));
            }
            Some("else") => match open.last_mut() {
                Some(top) if !top.1 => top.1 = true,
                _ => return Err(format!("line {}: `#else` without `#if`", number + 1)),
            },
            Some("endif") => {
                if open.pop().is_none() {
                    return Err(format!("line {}: `#endif` without `#if`", number + 1));
                }
            }
            _ => {
                if open.iter().all(|&(holds, in_else)| holds != in_else) {
                    out.push_str(line);
                }
            }
        }
        out.push('\n');
    }
    if !open.is_empty() {
        return Err(format!("{} `#if` block(s) never closed", open.len()));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_core::kernels::{MANIFEST, WEBGPU_COMPOSITIONS};

    #[test]
    fn nested_blocks_select_by_flag() {
        let src = "a\n// #if X\nb\n// #if !Y\nc\n// #else\nd\n// #endif\n// #else\ne\n// #endif\nf";
        let kept = |flags: &[&str]| -> Vec<String> {
            preprocess(src, flags)
                .unwrap()
                .lines()
                .filter(|l| !l.is_empty())
                .map(String::from)
                .collect()
        };
        assert_eq!(kept(&["X"]), ["a", "b", "c", "f"]);
        assert_eq!(kept(&["X", "Y"]), ["a", "b", "d", "f"]);
        assert_eq!(kept(&["Y"]), ["a", "e", "f"]);
    }

    #[test]
    fn unbalanced_directives_are_errors() {
        assert!(preprocess("// #if X\na", &[]).is_err());
        assert!(preprocess("a\n// #endif", &[]).is_err());
        assert!(preprocess("// #if X\n// #else\n// #else\n// #endif", &[]).is_err());
    }

    #[test]
    fn every_manifest_entry_has_a_source() {
        let composed = |name| WEBGPU_COMPOSITIONS.iter().any(|(n, _)| *n == name);
        for spec in MANIFEST {
            assert_eq!(
                kernel_source(spec.name).is_some(),
                !composed(spec.name),
                "{}",
                spec.name
            );
        }
        assert_eq!(SOURCES.len(), MANIFEST.len() - WEBGPU_COMPOSITIONS.len());
    }

    /// Every variant the backend can ask for, for every target.
    fn all_variants() -> Vec<ShaderVariant> {
        let mut variants = Vec::new();
        let shaders = MANIFEST
            .iter()
            .filter(|spec| kernel_source(spec.name).is_some());
        for spec in shaders {
            match spec.name {
                "embedding" => variants.extend(WeightFormat::ALL.map(|f| ShaderVariant {
                    kernel: spec.name,
                    format: Some(f),
                    kv_f16: false,
                })),
                "matmul_int4" => {
                    variants.extend(
                        [Int4Group::G64, Int4Group::G128].map(|group| ShaderVariant {
                            kernel: spec.name,
                            format: Some(WeightFormat::Int4 { group }),
                            kv_f16: false,
                        }),
                    )
                }
                name if FUSED_MATMULS.iter().any(|(fused, _)| *fused == name) => {
                    variants.extend(WeightFormat::ALL.map(|f| ShaderVariant {
                        kernel: name,
                        format: Some(f),
                        kv_f16: false,
                    }))
                }
                "paged_kv_write" | "paged_attention" => {
                    for kv_f16 in [false, true] {
                        variants.push(ShaderVariant {
                            kernel: spec.name,
                            format: None,
                            kv_f16,
                        });
                    }
                }
                name => variants.push(ShaderVariant {
                    kernel: name,
                    format: None,
                    kv_f16: false,
                }),
            }
        }
        for kv_f16 in [false, true] {
            variants.push(ShaderVariant {
                kernel: "paged_attention_scores",
                format: None,
                kv_f16,
            });
        }
        variants.push(ShaderVariant {
            kernel: "paged_attention_quant_scores",
            format: None,
            kv_f16: false,
        });
        variants
    }

    /// Compiles every variant with naga, so a broken shader fails here even
    /// on a machine without any adapter.
    #[test]
    fn every_variant_compiles_with_naga() {
        let mut failures = Vec::new();
        for f16 in [false, true] {
            for subgroups in [false, true] {
                let target = ShaderTarget {
                    f16,
                    subgroups,
                    browser: false,
                };
                for variant in all_variants() {
                    let text = generate(&variant, &target).unwrap();
                    let checked = naga::front::wgsl::parse_str(&text)
                        .map_err(|e| e.emit_to_string(&text))
                        .and_then(|module| {
                            naga::valid::Validator::new(
                                naga::valid::ValidationFlags::all(),
                                naga::valid::Capabilities::all(),
                            )
                            .validate(&module)
                            .map(drop)
                            .map_err(|e| e.emit_to_string(&text))
                        });
                    if let Err(e) = checked {
                        failures.push(format!("{variant:?} {target:?}:\n{e}"));
                    }
                }
            }
        }
        assert!(failures.is_empty(), "{}", failures.join("\n\n"));
    }

    /// Chrome's WGSL compiler (Tint) treats a struct parameter of an entry
    /// point as non-uniform when any of its members is, and then rejects
    /// barriers that follow a bounds check on the workgroup index; naga
    /// accepts such shaders. So no entry-point struct may hold a uniform
    /// builtin (`workgroup_id`, `num_workgroups`) next to a non-uniform one.
    #[test]
    fn every_entry_point_keeps_uniform_builtins_apart() {
        use naga::{Binding, BuiltIn, TypeInner};
        let uniform = |b: &Option<Binding>| {
            matches!(
                b,
                Some(Binding::BuiltIn(
                    BuiltIn::WorkGroupId | BuiltIn::NumWorkGroups
                ))
            )
        };
        let mut mixed = Vec::new();
        for subgroups in [false, true] {
            let target = ShaderTarget {
                f16: false,
                subgroups,
                browser: false,
            };
            for variant in all_variants() {
                let text = generate(&variant, &target).unwrap();
                let module = naga::front::wgsl::parse_str(&text).unwrap();
                for entry in &module.entry_points {
                    for arg in &entry.function.arguments {
                        if let TypeInner::Struct { members, .. } = &module.types[arg.ty].inner {
                            let uniform_members =
                                members.iter().filter(|m| uniform(&m.binding)).count();
                            if uniform_members != 0 && uniform_members != members.len() {
                                mixed.push(format!(
                                    "{variant:?} subgroups={subgroups}: entry point `{}`",
                                    entry.name
                                ));
                            }
                        }
                    }
                }
            }
        }
        assert!(
            mixed.is_empty(),
            "entry points whose struct parameter mixes workgroup_id/num_workgroups with \
             per-invocation builtins (take `ids: Ids, group: Group` instead):\n{}",
            mixed.join("\n")
        );
    }

    #[test]
    fn browser_text_enables_subgroups_and_native_text_does_not() {
        let variant = ShaderVariant {
            kernel: "rms_norm",
            format: None,
            kv_f16: false,
        };
        let mut target = ShaderTarget {
            f16: true,
            subgroups: true,
            browser: true,
        };
        let browser = generate(&variant, &target).unwrap();
        assert!(browser.starts_with("enable f16;\nenable subgroups;\n"));
        target.browser = false;
        let native = generate(&variant, &target).unwrap();
        assert!(!native.contains("enable subgroups"));
        assert!(native.contains("subgroupAdd"));
    }
}
