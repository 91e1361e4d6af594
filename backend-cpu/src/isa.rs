//! Which instruction set the hand-vectorized kernels use, chosen at run
//! time: the crate is built for the baseline target, so one binary runs on
//! any x86-64 and picks the best path the CPU has.

/// An instruction set this CPU supports. The field is private: values come
/// only from [`Isa::detect`] and [`Isa::available`], after checking the CPU,
/// which is what makes calling the kernels of an `Isa` sound.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Isa(IsaKind);

/// Instruction sets of the matmul micro-kernels, best first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum IsaKind {
    /// x86-64 AVX2 + FMA + F16C, plus AVX-512 F, BW, VL, VNNI, VBMI and
    /// BITALG: the quantized matmul kernels on 512-bit vectors (`vpmaddwd`
    /// and `vpdpwssd` per pair of 32-element runs, whose codes one VBMI
    /// byte permute puts in place; `vpdpbusd` over the nibble formats'
    /// codes, their fifth bits picked by BITALG's bit shuffle), byte masks,
    /// and 32 vector registers. CPUs with VNNI but not VBMI (Cascade Lake)
    /// take the AVX2 kernels; every CPU with VBMI has BITALG but Cannon
    /// Lake.
    #[cfg(target_arch = "x86_64")]
    Avx512Vnni,
    /// x86-64 AVX2 + FMA + F16C.
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// wasm SIMD128 (a build with `target-feature=+simd128`): the quantized
    /// matmul kernel's `i32x4.dot_i16x8_s`; everything else is portable.
    #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
    Simd128,
    /// Plain Rust the compiler vectorizes for the build target (SSE2, NEON,
    /// wasm simd128 when enabled).
    Portable,
}

/// The kernels a user asks for (`tandem --cpu-isa`): the best this CPU
/// runs, or a named set, to compare two paths on one machine or take the
/// path of a machine without the better one.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CpuIsa {
    #[default]
    Best,
    /// AVX2 + FMA + F16C with AVX-512 F, BW, VL, VNNI, VBMI and BITALG.
    Avx512,
    /// AVX2 + FMA + F16C.
    Avx2,
    /// Plain Rust, vectorized by the compiler for the build target.
    Portable,
}

impl CpuIsa {
    pub fn name(self) -> &'static str {
        match self {
            CpuIsa::Best => "best",
            CpuIsa::Avx512 => "AVX-512",
            CpuIsa::Avx2 => "AVX2",
            CpuIsa::Portable => "portable",
        }
    }
}

impl Isa {
    /// The best instruction set this CPU supports.
    pub(crate) fn detect() -> Self {
        Self::available()[0]
    }

    /// The instruction set `wanted` names, if this CPU supports it.
    pub(crate) fn choose(wanted: CpuIsa) -> Option<Self> {
        Self::available().into_iter().find(|isa| match wanted {
            CpuIsa::Best => true,
            #[cfg(target_arch = "x86_64")]
            CpuIsa::Avx512 => isa.0 == IsaKind::Avx512Vnni,
            #[cfg(target_arch = "x86_64")]
            CpuIsa::Avx2 => isa.0 == IsaKind::Avx2,
            CpuIsa::Portable => isa.0 == IsaKind::Portable,
            #[cfg(not(target_arch = "x86_64"))]
            CpuIsa::Avx512 | CpuIsa::Avx2 => false,
        })
    }

    /// Every instruction set this CPU supports, best first.
    // Off x86_64 the detection block is compiled out and only the push of
    // the portable kernels is left.
    #[cfg_attr(not(target_arch = "x86_64"), allow(clippy::vec_init_then_push))]
    pub(crate) fn available() -> Vec<Isa> {
        let mut isas = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 = is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c");
            // Each as the OS reports it: the detection also checks that the
            // OS saves the AVX-512 registers.
            if avx2
                && is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vl")
                && is_x86_feature_detected!("avx512vnni")
                && is_x86_feature_detected!("avx512vbmi")
                && is_x86_feature_detected!("avx512bitalg")
            {
                isas.push(Isa(IsaKind::Avx512Vnni));
            }
            if avx2 {
                isas.push(Isa(IsaKind::Avx2));
            }
        }
        #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
        isas.push(Isa(IsaKind::Simd128));
        isas.push(Isa(IsaKind::Portable));
        isas
    }

    pub(crate) fn kind(self) -> IsaKind {
        self.0
    }

    pub(crate) fn name(self) -> &'static str {
        match self.0 {
            #[cfg(target_arch = "x86_64")]
            IsaKind::Avx512Vnni => "AVX2+AVX512-VNNI+VBMI",
            #[cfg(target_arch = "x86_64")]
            IsaKind::Avx2 => "AVX2",
            #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
            IsaKind::Simd128 => "wasm SIMD128",
            IsaKind::Portable => "portable",
        }
    }
}
