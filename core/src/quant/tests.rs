use super::*;

#[test]
fn round_trip_error_is_bounded_by_the_step() {
    let src: Vec<f32> = (0..256)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
        .collect();
    let range = src.iter().fold(0f32, |a, v| a.max(v.abs())) * 2.0;
    for format in WeightFormat::ALL {
        let bytes = quantize_row(format, &src);
        assert_eq!(bytes.len() as u64, format.bytes_for(1, 256).unwrap());
        let mut back = vec![0.0; 256];
        dequantize_row(format, &bytes, &mut back);
        // Every block's range is at most the whole row's.
        let max_err = match format {
            // Q4_0 maps the block's largest magnitude to -8 exactly, so the
            // opposite extreme can be clamped at +7: a whole step of error.
            WeightFormat::Q4_0 => range / 16.0,
            WeightFormat::Q4_1 | WeightFormat::Int4 { .. } => range / 15.0 * 0.51,
            WeightFormat::Q8_0 | WeightFormat::Int8PerChannel | WeightFormat::W8A8 => {
                range / 254.0 * 0.51
            }
            WeightFormat::F16 | WeightFormat::BF16 => range / 256.0 * 0.51,
            WeightFormat::F32 => 0.0,
            // As Q4_0 with 32 levels: a whole step at the clamped end.
            WeightFormat::Q5_0 => range / 32.0,
            WeightFormat::Q5_1 => range / 31.0 * 0.51,
            // The largest magnitude maps to -127 exactly; the table ends
            // at 113 on the other side, 14 of its units short.
            WeightFormat::IQ4_NL => range / 2.0 * 14.0 / 127.0,
            // Per sub-block bounds are checked in `kquant`; over a row,
            // a coarse bound: the largest step of each format.
            WeightFormat::Q2_K => range / 3.0 * 1.6,
            WeightFormat::Q3_K => range / 7.0 * 1.6,
            WeightFormat::Q4_K => range / 15.0 * 1.6,
            WeightFormat::Q5_K => range / 31.0 * 1.6,
            WeightFormat::Q6_K => range / 63.0 * 1.6,
        };
        for (a, b) in src.iter().zip(&back) {
            assert!((a - b).abs() <= max_err + 1e-3, "{format}: {a} vs {b}");
        }
    }
}

#[test]
fn int4_with_groups_of_32_is_q4_1() {
    let src: Vec<f32> = (0..128)
        .map(|i| ((i * 13 % 29) as f32 - 9.0) / 3.0)
        .collect();
    let q4_1 = WeightFormat::int4(32).unwrap();
    assert_eq!(q4_1, WeightFormat::Q4_1);
    // One group of 64 decodes like two Q4_1 blocks sharing their `[d, m]`.
    let g64 = WeightFormat::int4(64).unwrap();
    let bytes = quantize_row(g64, &src);
    let mut as_g64 = vec![0.0; 128];
    dequantize_row(g64, &bytes, &mut as_g64);
    let mut as_q4_1 = vec![0.0; 128];
    for (group, out) in bytes.chunks(36).zip(as_q4_1.chunks_mut(64)) {
        let (head, runs) = group.split_at(4);
        let blocks: Vec<u8> = runs.chunks(16).flat_map(|r| [head, r].concat()).collect();
        dequantize_row(WeightFormat::Q4_1, &blocks, out);
    }
    assert_eq!(as_g64, as_q4_1);
    for bad in [0, 16, 48, 256] {
        assert!(WeightFormat::int4(bad).is_err(), "{bad}");
    }
}

#[test]
fn sizes_count_the_row_head() {
    let int8 = WeightFormat::Int8PerChannel;
    assert_eq!(int8.row_bytes(64), Some(68));
    assert_eq!(int8.bytes_for(3, 64), Some(204));
    assert_eq!(int8.row_bytes(48), None);
    let g128 = WeightFormat::int4(128).unwrap();
    assert_eq!(g128.row_bytes(256), Some(136));
    assert_eq!(g128.bytes_for(5, 192), None);
    assert_eq!(WeightFormat::Q8_0.bytes_for(2, 64), Some(136));
    assert_eq!(WeightFormat::F32.bytes_for(u64::MAX, 2), None);
    for format in WeightFormat::ALL {
        assert_eq!(WeightFormat::from_name(format.name()), Some(format));
    }
    assert_eq!(
        WeightFormat::GGML.map(|f| f.ggml_type().is_some()),
        [true; 14]
    );
    for format in WeightFormat::GGML {
        assert_eq!(
            WeightFormat::from_ggml_type(format.ggml_type().unwrap()),
            Some(format)
        );
    }
    assert_eq!(WeightFormat::Q4_K.row_bytes(512), Some(288));
    assert_eq!(WeightFormat::Q6_K.row_bytes(320), None);
}

#[test]
fn quantize_matrix_scales_each_row() {
    let src: Vec<f32> = (0..96).map(|i| if i < 32 { 0.01 } else { 100.0 }).collect();
    let bytes = quantize_matrix(WeightFormat::Int8PerChannel, 32, &src);
    let view = WeightView {
        format: WeightFormat::Int8PerChannel,
        rows: 3,
        cols: 32,
        data: &bytes,
    };
    assert_eq!(view.to_f32()[0], 0.01);
    assert_eq!(view.to_f32()[95], 100.0);
}
