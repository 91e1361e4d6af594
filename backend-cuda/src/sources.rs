//! The CUDA sources of the kernel set, embedded in the binary so a deployed
//! `tandem` needs nothing but the driver and NVRTC.
//!
//! One `kernels/NAME.cu` per manifest entry; the helpers they share live in
//! `kernels/common.cuh`, which [`translation_unit`] pastes in place of the
//! `#include "common.cuh"` line (NVRTC gets a single self-contained source,
//! no include path), with `#line` markers so diagnostics name the real file
//! and line.
//!
//! The fused matmul files ([`PER_FORMAT_FILES`]) hold entry points for every
//! weight format, minutes of NVRTC as a whole; the backend compiles them one
//! format at a time ([`format_unit`]).

/// One kernel file.
#[derive(Clone, Copy, Debug)]
pub struct KernelFile {
    /// Manifest name and file stem.
    pub name: &'static str,
    pub source: &'static str,
}

macro_rules! kernel_files {
    ($($name:literal),* $(,)?) => {
        &[$(KernelFile {
            name: $name,
            source: include_str!(concat!("../../kernels/", $name, ".cu")),
        }),*]
    };
}

/// Every kernel file, in manifest order.
pub const KERNEL_FILES: &[KernelFile] = kernel_files![
    "embedding",
    "rms_norm",
    "rms_norm_residual",
    "matmul_f32",
    "matmul_f16",
    "matmul_bf16",
    "matmul_q8_0",
    "matmul_q4_0",
    "matmul_q4_1",
    "matmul_int8",
    "matmul_w8a8",
    "matmul_int4",
    "matmul_q5_0",
    "matmul_q5_1",
    "matmul_iq4_nl",
    "matmul_q2_k",
    "matmul_q3_k",
    "matmul_q4_k",
    "matmul_q5_k",
    "matmul_q6_k",
    "matmul_rms_norm",
    "matmul_glu",
    "matmul_residual",
    "mlp_residual",
    "rope",
    "paged_kv_write",
    "paged_attention",
    "paged_kv_write_quant",
    "paged_kv_write_int4_keys",
    "paged_attention_quant",
    "kv_key_bounds",
    "select_kv_blocks",
    "swiglu",
    "geglu",
    "scale",
    "gather_rows",
    "moe_route",
    "moe_combine",
    "argmax",
];

/// Files the backend compiles once per weight format, not whole.
pub const PER_FORMAT_FILES: &[&str] = &[
    "matmul_rms_norm",
    "matmul_glu",
    "matmul_residual",
    "mlp_residual",
];

/// The header every kernel file includes.
pub const COMMON_HEADER: &str = include_str!("../../kernels/common.cuh");

const INCLUDE_LINE: &str = "#include \"common.cuh\"";

pub fn kernel_file(name: &str) -> Option<&'static KernelFile> {
    KERNEL_FILES.iter().find(|f| f.name == name)
}

/// The self-contained source NVRTC compiles for `NAME.cu`: the file with its
/// `#include "common.cuh"` line replaced by the header's text.
pub fn translation_unit(name: &str, source: &str) -> String {
    let mut out = String::with_capacity(COMMON_HEADER.len() + source.len() + 128);
    for (index, line) in source.lines().enumerate() {
        if line.trim() == INCLUDE_LINE {
            out.push_str("#line 1 \"common.cuh\"\n");
            out.push_str(COMMON_HEADER);
            if !COMMON_HEADER.ends_with('\n') {
                out.push('\n');
            }
            out.push_str(&format!("#line {} \"{name}.cu\"\n", index + 2));
        } else {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

/// The translation unit of a [`PER_FORMAT_FILES`] file with the entry points
/// of one weight format only, the one named `stem` (`f32`, `int4_g64`,
/// `q4_k`, ...): the format lists of `common.cuh` are defined first, naming
/// that format alone.
pub fn format_unit(name: &str, source: &str, stem: &str) -> String {
    let format = format!("M({stem}, FMT_{})", stem.to_ascii_uppercase());
    let float = if matches!(stem, "f32" | "f16" | "bf16") {
        format.as_str()
    } else {
        ""
    };
    let f32_activations = if stem == "w8a8" { "" } else { format.as_str() };
    format!(
        "#define FOR_EACH_MATMUL_FORMAT(M) {format}\n#define FOR_EACH_FLOAT_FORMAT(M) {float}\n\
         #define FOR_EACH_F32_ACTIVATION_FORMAT(M) {f32_activations}\n#line 1 \"{name}.cu\"\n{}",
        translation_unit(name, source)
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_core::kernels::MANIFEST;

    #[test]
    fn every_manifest_entry_has_an_embedded_source_and_no_more() {
        let embedded: Vec<&str> = KERNEL_FILES.iter().map(|f| f.name).collect();
        let manifest: Vec<&str> = MANIFEST.iter().map(|k| k.name).collect();
        assert_eq!(embedded, manifest);
    }

    #[test]
    fn a_format_unit_names_one_format() {
        let unit = format_unit("x", "#include \"common.cuh\"\n", "int4_g64");
        assert!(unit.starts_with(
            "#define FOR_EACH_MATMUL_FORMAT(M) M(int4_g64, FMT_INT4_G64)\n#define FOR_EACH_FLOAT_FORMAT(M) \n\
             #define FOR_EACH_F32_ACTIVATION_FORMAT(M) M(int4_g64, FMT_INT4_G64)\n#line 1 \"x.cu\"\n"
        ));
        assert!(unit.contains("#define FMT_INT4_G64 "));
        let unit = format_unit("x", "", "bf16");
        assert!(unit.contains("#define FOR_EACH_FLOAT_FORMAT(M) M(bf16, FMT_BF16)\n"));
        assert!(unit.contains("#define FOR_EACH_F32_ACTIVATION_FORMAT(M) M(bf16, FMT_BF16)\n"));
        let unit = format_unit("x", "", "w8a8");
        assert!(unit.contains("#define FOR_EACH_F32_ACTIVATION_FORMAT(M) \n"));
        for name in PER_FORMAT_FILES {
            assert!(kernel_file(name).is_some_and(|f| f.source.contains("FOR_EACH_")));
        }
    }

    #[test]
    fn the_header_is_pasted_with_line_markers() {
        let unit = translation_unit("x", "// one\n#include \"common.cuh\"\nint y;\n");
        assert!(unit.starts_with("// one\n#line 1 \"common.cuh\"\n"));
        assert!(unit.contains(COMMON_HEADER.trim_end()));
        assert!(unit.ends_with("#line 3 \"x.cu\"\nint y;\n"));
    }
}
