//! The methods on a whole (tiny, random) model: smoothing leaves the float
//! function unchanged, calibration input is checked, and every method's
//! output loads back with the formats and values it claims.

use std::collections::HashMap;
use std::path::Path;

use tandem_core::backend::RopeStyle;
use tandem_core::model::safetensors::write_model_dir;
use tandem_core::model::synthetic::SyntheticModel;
use tandem_core::quant::WeightFormat;
use tandem_quantize::calib::{self, Calibration};
use tandem_quantize::dense::{DenseModel, Site, Tensor};
use tandem_quantize::fold;
use tandem_quantize::plan::{self, CalibrationText, Method, Options};
use tandem_quantize::smoothquant;

/// The tiny synthetic model in f32, Hugging Face layout (NeoX RoPE).
fn tiny_dense() -> DenseModel {
    let synthetic = SyntheticModel::preset("tiny", WeightFormat::F32, 5).unwrap();
    let mut config = synthetic.config.clone();
    config.rope_style = RopeStyle::NeoX;
    let tensors: HashMap<String, Tensor> = synthetic
        .f32_tensors()
        .into_iter()
        .map(|t| {
            let cols = t.shape[0];
            let rows = t.data.len() / cols;
            (
                t.name,
                Tensor {
                    rows,
                    cols,
                    data: t.data,
                },
            )
        })
        .collect();
    DenseModel::new(config, tensors).unwrap()
}

fn windows() -> Vec<Vec<u32>> {
    (0..3u32)
        .map(|w| (0..40u32).map(|i| (i * 37 + w * 101 + 7) % 300).collect())
        .collect()
}

fn max_relative_difference(a: &[f32], b: &[f32]) -> f32 {
    let scale = a.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
        / scale
}

#[test]
fn smoothing_keeps_the_float_model_function() {
    let mut model = tiny_dense();
    let calibration: Calibration = calib::collect(&model, &windows(), 64).unwrap();
    let tokens = &windows()[1];
    let before = model.forward(tokens).unwrap();
    let c = model.config.clone();
    for l in 0..c.num_layers {
        for site in Site::ALL {
            let stats = calibration.site(l, site);
            let act_max = fold::reduce(&c, site, &stats.max_abs, f32::max);
            let mut weight_max = vec![0.0f32; act_max.len()];
            for stem in site.linears() {
                let t = model.tensor(&format!("blk.{l}.{stem}.weight")).unwrap();
                for row in t.data.chunks_exact(t.cols) {
                    for (ch, v) in row.iter().enumerate() {
                        let m = &mut weight_max[fold::factor_of(&c, site, ch)];
                        *m = m.max(v.abs());
                    }
                }
            }
            let s = smoothquant::factors(&act_max, &weight_max, 0.5);
            // The factors really change the weights.
            assert!(s.iter().any(|v| (v - 1.0).abs() > 0.1), "{site:?}");
            fold::apply(&mut model, l, site, &s).unwrap();
        }
    }
    let after = model.forward(tokens).unwrap();
    let d = max_relative_difference(&before, &after);
    assert!(d < 1e-4, "smoothed logits differ by {d}");
}

#[test]
fn bad_smoothing_factors_are_refused() {
    let mut model = tiny_dense();
    let e = fold::apply(&mut model, 0, Site::AttnOut, &[1.0; 64])
        .unwrap_err()
        .to_string();
    // Grouped-query attention: one factor per KV channel (2 heads × 16).
    assert!(e.contains("expected 32"), "{e}");
    let e = fold::apply(&mut model, 0, Site::FfnIn, &[0.0; 64])
        .unwrap_err()
        .to_string();
    assert!(e.contains("positive finite"), "{e}");
}

#[test]
fn calibration_file_must_exist_and_have_text() {
    let files = SyntheticModel::preset("tiny", WeightFormat::Q4_1, 1)
        .unwrap()
        .files()
        .unwrap();
    let dir = std::env::temp_dir().join(format!("tandem-quantize-calib-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let e = calib::windows(&files.tokenizer, Path::new("/no/such/calib.txt"), 512, 64)
        .unwrap_err()
        .to_string();
    assert!(e.contains("calibration file /no/such/calib.txt"), "{e}");
    let empty = dir.join("empty.txt");
    std::fs::write(&empty, " \n").unwrap();
    let e = calib::windows(&files.tokenizer, &empty, 512, 64)
        .unwrap_err()
        .to_string();
    assert!(e.contains("is empty"), "{e}");
    let short = dir.join("short.txt");
    std::fs::write(&short, "hi").unwrap();
    let e = calib::windows(&files.tokenizer, &short, 512, 64)
        .unwrap_err()
        .to_string();
    assert!(e.contains("fewer than 16"), "{e}");
    let text = dir.join("text.txt");
    std::fs::write(
        &text,
        "The quick brown fox jumps over the lazy dog. ".repeat(20),
    )
    .unwrap();
    let w = calib::windows(&files.tokenizer, &text, 200, 64).unwrap();
    // 200 tokens in windows of 64: the 8-token tail is too short to keep.
    assert_eq!(w.iter().map(Vec::len).collect::<Vec<_>>(), [64, 64, 64]);
    assert!(w.iter().all(|w| w.len() <= 64));
    std::fs::remove_dir_all(&dir).unwrap();
}

fn options(method: Method, bits: Option<u32>, group: usize, budget: Option<f64>) -> Options {
    Options {
        method,
        bits,
        group,
        act_order: false,
        budget_bits: budget,
    }
}

#[test]
fn bad_options_are_refused_before_any_work() {
    let files = SyntheticModel::preset("tiny", WeightFormat::Q4_1, 1)
        .unwrap()
        .files()
        .unwrap();
    let cases = [
        (
            options(Method::Rtn, Some(5), 32, None),
            "5-bit weights are not supported",
        ),
        (
            options(Method::Rtn, Some(4), 48, None),
            "group size 48 is not supported",
        ),
        // The tiny model's FFN is 160 wide.
        (
            options(Method::Rtn, Some(4), 64, None),
            "group size 64 does not divide the 160 columns of blk.0.ffn_down.weight",
        ),
        (
            options(Method::Int8, Some(4), 32, None),
            "--method int8 is 8-bit",
        ),
        (
            options(Method::Mixed, None, 32, None),
            "needs --budget-bits",
        ),
        (
            options(Method::Gptq, None, 32, Some(5.0)),
            "--budget-bits applies to --method mixed only",
        ),
        (
            options(Method::Gptq, None, 32, None),
            "needs calibration text",
        ),
    ];
    for (opts, needle) in cases {
        let e = plan::quantize(&files, &opts, None, &mut |_| {})
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains(needle), "{opts:?}: {e}");
    }
}

/// Quantizes the tiny model with each method, writes it, loads it back and
/// checks the formats of its linears and that its logits stay close to the
/// float model's.
#[test]
fn every_method_writes_a_loadable_model() {
    let synthetic = SyntheticModel::preset("tiny", WeightFormat::Q4_1, 3).unwrap();
    let files = synthetic.files().unwrap();
    let reference = DenseModel::from_files(&files).unwrap();
    let windows = windows();
    let calibration = CalibrationText {
        sensitivity: windows[..1].to_vec(),
        windows: windows.clone(),
    };
    let tokens = &windows[2];
    let want = reference.forward(tokens).unwrap();
    let root = std::env::temp_dir().join(format!("tandem-quantize-methods-{}", std::process::id()));
    let cases = [
        (
            options(Method::F16, None, 32, None),
            WeightFormat::F16,
            5e-3,
        ),
        (
            options(Method::Int8, None, 32, None),
            WeightFormat::Int8PerChannel,
            0.03,
        ),
        (
            options(Method::SmoothQuant, None, 32, None),
            WeightFormat::W8A8,
            0.03,
        ),
        (
            options(Method::Rtn, None, 32, None),
            WeightFormat::Q4_1,
            0.3,
        ),
        (
            options(Method::Gptq, None, 32, None),
            WeightFormat::Q4_1,
            0.3,
        ),
        (
            options(Method::Awq, None, 32, None),
            WeightFormat::Q4_1,
            0.3,
        ),
        (
            options(Method::Mixed, None, 32, Some(16.0)),
            WeightFormat::F16,
            5e-3,
        ),
    ];
    for (opts, format, tolerance) in cases {
        let q = plan::quantize(&files, &opts, Some(&calibration), &mut |_| {}).unwrap();
        let dir = root.join(opts.method.name());
        write_model_dir(&files, q.tensors, &q.metadata, &dir).unwrap();
        let loaded = tandem_core::model::load(&dir).unwrap();
        let info = loaded.tensors.info("blk.1.ffn_down.weight").unwrap();
        assert_eq!(info.format, format, "{:?}", opts.method);
        assert!(loaded
            .metadata
            .iter()
            .any(|(k, v)| k.ends_with("quantization.method") && v == opts.method.name()));
        // W8A8 also quantizes activations, which this f32 pass does not; its
        // weights alone must be close.
        let got = DenseModel::from_files(&loaded)
            .unwrap()
            .forward(tokens)
            .unwrap();
        let d = max_relative_difference(&want, &got);
        eprintln!("{:?}: logits differ by {d}", opts.method);
        assert!(d < tolerance, "{:?}: logits differ by {d}", opts.method);
    }
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn mixed_precision_follows_the_budget() {
    let files = SyntheticModel::preset("tiny", WeightFormat::Q4_1, 4)
        .unwrap()
        .files()
        .unwrap();
    let windows = windows();
    let calibration = CalibrationText {
        sensitivity: windows[..1].to_vec(),
        windows: windows.clone(),
    };
    // Two equal layers: INT4 g32 is 5 bits/weight, INT8 with its f32 row
    // scales 8.5 (64 columns) or 8.2 (160): 7 bits/weight buys one INT8 layer.
    let opts = options(Method::Mixed, None, 32, Some(7.0));
    let q = plan::quantize(&files, &opts, Some(&calibration), &mut |_| {}).unwrap();
    let formats: Vec<WeightFormat> = (0..2)
        .map(|l| {
            q.tensors
                .iter()
                .find(|t| t.name == format!("blk.{l}.attn_q.weight"))
                .unwrap()
                .format
        })
        .collect();
    let mut sorted = formats.clone();
    sorted.sort_by_key(|f| f.name());
    assert_eq!(
        sorted,
        [WeightFormat::Int8PerChannel, WeightFormat::Q4_1],
        "{formats:?}"
    );
    assert!(q
        .metadata
        .iter()
        .any(|(k, v)| k.ends_with("quantization.layer.0") && v.contains("KL if INT8")));
    let e = plan::quantize(
        &files,
        &options(Method::Mixed, None, 32, Some(4.0)),
        Some(&calibration),
        &mut |_| {},
    )
    .err()
    .unwrap()
    .to_string();
    assert!(
        e.contains("below the smallest plan (5.000 bits per weight)"),
        "{e}"
    );
}

/// Sum of squared logit errors of `model` against `reference` over `windows`.
fn logit_error(reference: &DenseModel, model: &DenseModel, windows: &[Vec<u32>]) -> f64 {
    windows
        .iter()
        .map(|w| {
            let want = reference.forward(w).unwrap();
            let got = model.forward(w).unwrap();
            want.iter()
                .zip(&got)
                .map(|(a, b)| ((a - b) as f64).powi(2))
                .sum::<f64>()
        })
        .sum()
}

/// Whole-model GPTQ (sequential, with and without act-order) keeps the
/// logits on the calibration text closer to the float model's than
/// round-to-nearest at the same bits, on a model with more layers than the
/// error of one layer alone would show.
#[test]
fn gptq_model_is_closer_to_the_float_model_than_rtn() {
    let files = SyntheticModel::preset("tiny", WeightFormat::Q4_1, 4)
        .unwrap()
        .files()
        .unwrap();
    let reference = DenseModel::from_files(&files).unwrap();
    let windows = windows();
    let calibration = CalibrationText {
        sensitivity: windows[..1].to_vec(),
        windows: windows.clone(),
    };
    let error_of = |opts: &Options| {
        let q = plan::quantize(&files, opts, Some(&calibration), &mut |_| {}).unwrap();
        let dir = std::env::temp_dir().join(format!(
            "tandem-quantize-gptq-{}-{}",
            std::process::id(),
            opts.act_order
        ));
        write_model_dir(&files, q.tensors, &q.metadata, &dir).unwrap();
        let model = DenseModel::from_files(&tandem_core::model::load(&dir).unwrap()).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        logit_error(&reference, &model, &windows)
    };
    let rtn_error = error_of(&options(Method::Rtn, Some(4), 32, None));
    for act_order in [false, true] {
        let mut gptq = options(Method::Gptq, Some(4), 32, None);
        gptq.act_order = act_order;
        let gptq_error = error_of(&gptq);
        eprintln!("act-order {act_order}: GPTQ {gptq_error:.4e}, RTN {rtn_error:.4e}");
        assert!(
            gptq_error < 0.85 * rtn_error,
            "act-order {act_order}: GPTQ's logit error {gptq_error:.4e} is not below 0.85 × RTN's {rtn_error:.4e}"
        );
    }
}
