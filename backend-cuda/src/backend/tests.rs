use super::*;

#[test]
fn decode_splits_fill_the_gpu_without_tiny_splits() {
    // One sequence, 32 heads, 4K context, 132 SMs: 9 splits fill 2 x 132 SMs.
    assert_eq!(decode_splits(4096, 32, 132), 9);
    // Short context: never shorter than MIN_SPLIT_KEYS.
    assert_eq!(decode_splits(300, 32, 132), 2);
    assert_eq!(decode_splits(100, 32, 132), 1);
    // Many rows already fill the GPU.
    assert_eq!(decode_splits(4096, 32 * 16, 132), 1);
    // Very long contexts are capped.
    assert_eq!(decode_splits(1 << 20, 1, 132), MAX_SPLITS);
}

#[test]
fn prefill_shared_memory_matches_the_kernel_layout() {
    // head_dim 128: 16*128 + 32*129 + 32*128 floats, then 32 i64 slots.
    assert_eq!(prefill_shared_bytes(128), (2048 + 4128 + 4096) * 4 + 256);
    assert!(prefill_shared_bytes(128) <= DEFAULT_SMEM_LIMIT);
    assert!(prefill_shared_bytes(256) > DEFAULT_SMEM_LIMIT);
}

#[test]
fn matmul_entry_points_are_named_as_the_kernels_declare_them() {
    for format in WeightFormat::ALL {
        let stem = format_stem(format);
        let fmt = format!("FMT_{}", stem.to_ascii_uppercase());
        // The fused files' entry points, and their per-format units.
        assert!(
            sources::COMMON_HEADER.contains(&format!("M({stem}, {fmt})")),
            "{format}: common.cuh lists no {stem}"
        );
        let file = sources::kernel_file(matmul_kernel_name(format)).unwrap();
        assert!(
            file.source
                .contains(&format!("DEFINE_MATMUL(matmul_{stem}, {fmt})")),
            "{format}: {}.cu declares no matmul_{stem}_* entry points",
            file.name
        );
        let unaligned = format!("DEFINE_MATMUL_UNALIGNED(matmul_{stem}, {fmt})");
        assert_eq!(
            file.source.contains(&unaligned),
            !format.is_quantized(),
            "{format}: an unaligned GEMV exactly for float formats"
        );
    }
}

#[test]
fn the_one_kernel_mlp_takes_decode_shapes_of_one_f32_activation_format() {
    let q4 = WeightFormat::Q4_K;
    let entry = |formats: [WeightFormat; 2], dim, f, rows| {
        mlp_variant(formats, dim, f, rows).map(|(variant, cfg)| {
            let which = Which::format_variant(formats[0], &variant);
            (
                sig::MLP_RESIDUAL.resolve(which).unwrap().entry,
                cfg.grid_dim.0,
            )
        })
    };
    assert_eq!(
        entry([q4; 2], 256, 512, 1),
        Some(("mlp_residual_q4_k_t1".into(), 16))
    );
    assert_eq!(
        entry([q4; 2], 256, 512, 3),
        Some(("mlp_residual_q4_k_t8".into(), 16))
    );
    assert_eq!(
        entry([WeightFormat::F16; 2], 48, 64, 8),
        Some(("mlp_residual_f16_t8".into(), 2))
    );
    assert_eq!(entry([q4; 2], 256, 512, 9), None);
    assert_eq!(entry([q4, WeightFormat::Q6_K], 256, 512, 1), None);
    assert_eq!(entry([WeightFormat::W8A8; 2], 64, 32, 1), None);
    assert_eq!(entry([WeightFormat::F32; 2], 48, 37, 1), None);
    assert_eq!(entry([WeightFormat::F32; 2], 45, 64, 1), None);
}

#[test]
fn matmul_variants_follow_the_tokens_and_the_row_alignment() {
    let variant = |format, cols, rows| {
        let (name, cfg) = matmul_variant(format, 101, cols, rows).unwrap();
        (name, cfg.grid_dim, cfg.block_dim.0)
    };
    let gemv = |t: usize| (format!("gemv_t{t}"), (51, 1, 1), GEMV_THREADS);
    assert_eq!(variant(WeightFormat::Q4_K, 256, 1), gemv(1));
    assert_eq!(variant(WeightFormat::Q4_K, 256, 3), gemv(4));
    assert_eq!(variant(WeightFormat::F32, 48, 8), gemv(8));
    // Rows of 45 floats are not 16-byte aligned: 8 rows per block.
    assert_eq!(
        variant(WeightFormat::F32, 45, 8),
        ("gemv_unaligned".to_string(), (13, 1, 1), GEMV_THREADS)
    );
    assert_eq!(
        variant(WeightFormat::F16, 45, 130),
        ("tiled".to_string(), (2, 3, 1), TILE_THREADS)
    );
}

#[test]
fn row_kernels_use_whole_warps() {
    assert_eq!(row_threads(1), 32);
    assert_eq!(row_threads(576), 160);
    assert_eq!(row_threads(4096), 1024);
    assert_eq!(row_threads(1 << 20), 1024);
}

#[test]
fn device_discovery_answers_with_or_without_a_driver() {
    if crate::driver_present() {
        // A driver with or without devices: a list, possibly empty.
        crate::list_devices().unwrap();
    } else {
        let err = CudaBackend::new(0)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.contains("no CUDA driver found"), "{err}");
        let err = crate::list_devices()
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.contains("no CUDA driver found"), "{err}");
    }
}
