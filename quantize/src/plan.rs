//! A method applied to a whole model: which tensors are quantized how, in
//! what order, and the encoded tensors and metadata to write.
//!
//! Only the linear layers of the transformer blocks are quantized. The
//! embedding table (also the output matrix when tied), `output.weight` and
//! the norm vectors keep their stored bytes, unless a method folded
//! smoothing factors into a norm, which is then written as F32. The source
//! model's dequantized weights are the full-precision reference every
//! method starts from (for the default Q4_1 model: its Q4_1 values).

use std::collections::HashMap;

use tandem_core::model::safetensors::OutputTensor;
use tandem_core::model::ModelFiles;
use tandem_core::quant::{pack_int4_groups, pack_int8_per_channel, quantize_row, WeightFormat};

use crate::awq::{self, Reader};
use crate::calib::{self, Calibration, LayerInputs};
use crate::dense::{linear_name, DenseModel, Site, LINEARS};
use crate::fold;
use crate::gptq::{self, GptqOptions, HessianFactor};
use crate::grid::{QuantizedMatrix, Scheme};
use crate::mixed::{self, Choice, Precision};
use crate::{invalid, rtn, smoothquant, Result};

/// Rows kept per site for SmoothQuant's alpha search.
const SAMPLE_ROWS: usize = 512;

/// The calibration text, cut into windows (see [`calib::windows`]).
pub struct CalibrationText {
    /// Windows the statistics (Hessians, activation ranges) come from.
    pub windows: Vec<Vec<u32>>,
    /// Windows on which mixed precision measures each layer's sensitivity.
    pub sensitivity: Vec<Vec<u32>>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Method {
    /// Every matrix in F16 (the full-precision reference as a file).
    F16,
    Rtn,
    Int8,
    SmoothQuant,
    Gptq,
    Awq,
    Mixed,
}

impl Method {
    pub const NAMES: [&'static str; 7] = [
        "f16",
        "rtn",
        "int8",
        "w8a8-smoothquant",
        "gptq",
        "awq",
        "mixed",
    ];

    pub fn from_name(name: &str) -> Result<Method> {
        Ok(match name {
            "f16" => Method::F16,
            "rtn" => Method::Rtn,
            "int8" => Method::Int8,
            "w8a8-smoothquant" => Method::SmoothQuant,
            "gptq" => Method::Gptq,
            "awq" => Method::Awq,
            "mixed" => Method::Mixed,
            other => {
                return invalid(format!(
                    "unknown method '{other}' (known: {})",
                    Method::NAMES.join(", ")
                ))
            }
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Method::F16 => "f16",
            Method::Rtn => "rtn",
            Method::Int8 => "int8",
            Method::SmoothQuant => "w8a8-smoothquant",
            Method::Gptq => "gptq",
            Method::Awq => "awq",
            Method::Mixed => "mixed",
        }
    }

    pub fn needs_calibration(self) -> bool {
        matches!(
            self,
            Method::SmoothQuant | Method::Gptq | Method::Awq | Method::Mixed
        )
    }
}

#[derive(Clone, Debug)]
pub struct Options {
    pub method: Method,
    /// 3, 4 or 8 (rtn, gptq, awq); INT4 layers of `mixed` use 4. `None`:
    /// the method's own (8 for int8 and W8A8, 4 otherwise).
    pub bits: Option<u32>,
    pub group: usize,
    pub act_order: bool,
    /// Bits per weight of the quantized linears (mixed only).
    pub budget_bits: Option<f64>,
}

impl Options {
    /// Checks the combination of options, before any work.
    pub fn scheme(&self) -> Result<Option<Scheme>> {
        let m = self.method;
        if self.budget_bits.is_some() != (m == Method::Mixed) {
            return invalid(if m == Method::Mixed {
                "--method mixed needs --budget-bits B (bits per weight, e.g. 5)".to_string()
            } else {
                format!(
                    "--budget-bits applies to --method mixed only, not {}",
                    m.name()
                )
            });
        }
        if let Some(b) = self.budget_bits {
            if !(b.is_finite() && b > 0.0) {
                return invalid(format!("--budget-bits must be a positive number, not {b}"));
            }
        }
        match (m, self.bits) {
            (Method::F16, None) => Ok(None),
            (Method::F16, Some(b)) => invalid(format!("--method f16 takes no --bits (got {b})")),
            (Method::Int8 | Method::SmoothQuant, None | Some(8)) => Ok(Some(Scheme::Int8PerChannel)),
            (Method::Int8 | Method::SmoothQuant, Some(b)) => {
                invalid(format!("--method {} is 8-bit; --bits {b} is not supported", m.name()))
            }
            (Method::Mixed, None | Some(4)) => Scheme::new(4, self.group).map(Some),
            (Method::Mixed, Some(b)) => invalid(format!(
                "--method mixed chooses among F16, INT8 and INT4 itself; --bits {b} is not supported"
            )),
            (Method::Rtn | Method::Gptq | Method::Awq, bits) => Scheme::new(bits.unwrap_or(4), self.group).map(Some),
        }
    }
}

/// The result: the tensors that differ from the source's (the writer copies
/// the others), metadata describing the quantization, and one line per
/// layer for the user.
pub struct QuantizedModel {
    pub tensors: Vec<OutputTensor>,
    pub metadata: Vec<(String, String)>,
    pub report: Vec<String>,
}

/// How one linear ends up.
enum Encoded {
    Float(Vec<f32>),
    Quantized(QuantizedMatrix, WeightFormat),
}

fn encode_matrix(q: &QuantizedMatrix, format: WeightFormat) -> Result<Vec<u8>> {
    Ok(match q.scheme {
        Scheme::Int8PerChannel => pack_int8_per_channel(q.rows, q.cols, &q.codes, &q.scales())?,
        Scheme::Groups { group, .. } => {
            let codes: Vec<u8> = q.codes.iter().map(|&c| c as u8).collect();
            debug_assert_eq!(format, WeightFormat::int4(group)?);
            pack_int4_groups(q.rows, q.cols, group, &codes, &q.scales(), &q.mins())?
        }
    })
}

fn format_of(scheme: Scheme, w8a8: bool) -> Result<WeightFormat> {
    Ok(match scheme {
        Scheme::Int8PerChannel if w8a8 => WeightFormat::W8A8,
        Scheme::Int8PerChannel => WeightFormat::Int8PerChannel,
        Scheme::Groups { group, .. } => WeightFormat::int4(group)?,
    })
}

fn readers<'a>(model: &'a DenseModel, names: &'a [String]) -> Result<Vec<Reader<'a>>> {
    names
        .iter()
        .map(|name| {
            let t = model.tensor(name)?;
            Ok(Reader {
                name,
                weights: &t.data,
                rows: t.rows,
            })
        })
        .collect()
}

fn site_names(layer: usize, site: Site) -> Vec<String> {
    site.linears()
        .iter()
        .map(|s| linear_name(layer, s))
        .collect()
}

fn factor_map(model: &DenseModel, site: Site, width: usize) -> Vec<usize> {
    (0..width)
        .map(|c| fold::factor_of(&model.config, site, c))
        .collect()
}

/// Quantizes `files` with `opts`; `calibration` is required by the methods
/// that use it. `log` receives progress lines.
pub fn quantize(
    files: &ModelFiles,
    opts: &Options,
    calibration: Option<&CalibrationText>,
    log: &mut dyn FnMut(String),
) -> Result<QuantizedModel> {
    let scheme = opts.scheme()?;
    if opts.method.needs_calibration() && calibration.is_none() {
        return invalid(format!(
            "--method {} needs calibration text (--calib FILE)",
            opts.method.name()
        ));
    }
    let mut model = DenseModel::from_files(files)?;
    let layers = model.config.num_layers;
    if let Some(s) = scheme {
        for l in 0..layers {
            for stem in LINEARS {
                let name = linear_name(l, stem);
                let cols = model.tensor(&name)?.cols;
                s.check_cols(&name, cols)?;
                let int8 = s == Scheme::Int8PerChannel || opts.method == Method::Mixed;
                if int8 && !cols.is_multiple_of(32) {
                    return invalid(format!(
                        "{name} has {cols} columns; INT8 storage needs a multiple of 32"
                    ));
                }
            }
        }
    }
    let mut encoded: HashMap<String, Encoded> = HashMap::new();
    let mut report = Vec::new();
    let mut metadata = vec![
        (
            "quantization.method".to_string(),
            opts.method.name().to_string(),
        ),
        (
            "quantization.baseline".to_string(),
            format!("dequantized weights of {}", files.path.display()),
        ),
    ];
    if let Some(Scheme::Groups { bits, group }) = scheme {
        metadata.push(("quantization.bits".into(), bits.to_string()));
        metadata.push(("quantization.group_size".into(), group.to_string()));
    }
    if let Some(text) = calibration {
        let tokens: usize = text.windows.iter().map(Vec::len).sum();
        metadata.push(("quantization.calibration_tokens".into(), tokens.to_string()));
    }
    // The float model's statistics, for the methods that calibrate every
    // layer on float inputs.
    let float_statistics =
        |model: &DenseModel, log: &mut dyn FnMut(String)| -> Result<Calibration> {
            let text = calibration.expect("checked");
            let stats = calib::collect(model, &text.windows, SAMPLE_ROWS)?;
            log("calibration statistics collected".into());
            Ok(stats)
        };
    let linear_weights = |model: &DenseModel, name: &str| -> Result<(Vec<f32>, usize, usize)> {
        let t = model.tensor(name)?;
        Ok((t.data.clone(), t.rows, t.cols))
    };
    match opts.method {
        Method::F16 => {
            for l in 0..layers {
                for stem in LINEARS {
                    let name = linear_name(l, stem);
                    encoded.insert(
                        name.clone(),
                        Encoded::Float(linear_weights(&model, &name)?.0),
                    );
                }
            }
        }
        Method::Rtn | Method::Int8 => {
            let s = scheme.expect("checked");
            for l in 0..layers {
                for stem in LINEARS {
                    let name = linear_name(l, stem);
                    let (w, rows, cols) = linear_weights(&model, &name)?;
                    let q = rtn::quantize(s, &name, &w, rows, cols)?;
                    encoded.insert(name, Encoded::Quantized(q, format_of(s, false)?));
                }
            }
        }
        Method::Gptq => {
            // Sequential: each layer's Hessians come from the output of the
            // layers already quantized, as in the GPTQ paper.
            let text = calibration.expect("checked");
            let s = scheme.expect("checked");
            let g = GptqOptions {
                act_order: opts.act_order,
                ..Default::default()
            };
            let mut inputs = LayerInputs::new(&model, &text.windows)?;
            for l in 0..layers {
                let stats = inputs.stats(&model, 1)?;
                for site in Site::ALL {
                    let stats = &stats[&site];
                    let names = site_names(l, site);
                    let factor = HessianFactor::new(&names[0], &stats.hessian, stats.width, g)?;
                    for name in names {
                        let (w, rows, _) = linear_weights(&model, &name)?;
                        let q = gptq::quantize_with(s, &name, &w, rows, &factor)?;
                        model.set(&name, q.dequantize())?;
                        encoded.insert(name, Encoded::Quantized(q, format_of(s, false)?));
                    }
                }
                inputs.advance(&model)?;
                log(format!("gptq: layer {l} done"));
            }
        }
        Method::Awq => {
            let calib = float_statistics(&model, log)?;
            let s = scheme.expect("checked");
            for l in 0..layers {
                let mut line = format!("layer {l}: alpha");
                for site in Site::ALL {
                    let stats = calib.site(l, site);
                    let names = site_names(l, site);
                    let mean_abs = fold::reduce(&model.config, site, &stats.mean_abs, f32::max);
                    let map = factor_map(&model, site, stats.width);
                    let found = {
                        let r = readers(&model, &names)?;
                        awq::search(model.cpu(), s, &r, &stats.hessian, &mean_abs, &map, 20)?
                    };
                    line += &format!(
                        " {site:?}={} ({:.1}% of RTN's error)",
                        found.alpha,
                        100.0 * found.error / found.rtn_error.max(f64::MIN_POSITIVE)
                    );
                    fold::apply(&mut model, l, site, &found.factors)?;
                }
                for stem in LINEARS {
                    let name = linear_name(l, stem);
                    let (w, rows, cols) = linear_weights(&model, &name)?;
                    let q = rtn::quantize(s, &name, &w, rows, cols)?;
                    encoded.insert(name, Encoded::Quantized(q, format_of(s, false)?));
                }
                log(line.clone());
                report.push(line);
            }
        }
        Method::SmoothQuant => {
            let calib = float_statistics(&model, log)?;
            for l in 0..layers {
                let mut line = format!("layer {l}: alpha");
                for site in Site::ALL {
                    let stats = calib.site(l, site);
                    let names = site_names(l, site);
                    let act_max = fold::reduce(&model.config, site, &stats.max_abs, f32::max);
                    let map = factor_map(&model, site, stats.width);
                    let found = {
                        let r = readers(&model, &names)?;
                        smoothquant::search(
                            model.cpu(),
                            &r,
                            &stats.samples,
                            stats.sample_rows(),
                            &act_max,
                            &map,
                        )?
                    };
                    line += &format!(
                        " {site:?}={} ({:.1}% of plain W8A8's error)",
                        found.alpha.map_or("none".to_string(), |a| a.to_string()),
                        100.0 * found.error / found.unsmoothed_error.max(f64::MIN_POSITIVE)
                    );
                    if found.alpha.is_some() {
                        fold::apply(&mut model, l, site, &found.factors)?;
                    }
                }
                for stem in LINEARS {
                    let name = linear_name(l, stem);
                    let (w, rows, cols) = linear_weights(&model, &name)?;
                    let q = rtn::quantize(Scheme::Int8PerChannel, &name, &w, rows, cols)?;
                    encoded.insert(name, Encoded::Quantized(q, WeightFormat::W8A8));
                }
                log(line.clone());
                report.push(line);
            }
        }
        Method::Mixed => {
            let calib = float_statistics(&model, log)?;
            let windows = &calibration.expect("checked").sensitivity;
            let s4 = scheme.expect("checked");
            let g = GptqOptions {
                act_order: opts.act_order,
                ..Default::default()
            };
            let mut int4: Vec<Vec<(String, QuantizedMatrix)>> = Vec::with_capacity(layers);
            let mut int8: Vec<Vec<(String, QuantizedMatrix)>> = Vec::with_capacity(layers);
            for l in 0..layers {
                let (mut q4, mut q8) = (Vec::new(), Vec::new());
                for site in Site::ALL {
                    let stats = calib.site(l, site);
                    let names = site_names(l, site);
                    let factor = HessianFactor::new(&names[0], &stats.hessian, stats.width, g)?;
                    for name in names {
                        let (w, rows, cols) = linear_weights(&model, &name)?;
                        q4.push((
                            name.clone(),
                            gptq::quantize_with(s4, &name, &w, rows, &factor)?,
                        ));
                        q8.push((
                            name.clone(),
                            rtn::quantize(Scheme::Int8PerChannel, &name, &w, rows, cols)?,
                        ));
                    }
                }
                int4.push(q4);
                int8.push(q8);
                log(format!("mixed: layer {l} quantized (GPTQ INT4, RTN INT8)"));
            }
            let candidates: Vec<Vec<mixed::LayerWeights>> = (0..layers)
                .map(|l| {
                    let deq = |v: &Vec<(String, QuantizedMatrix)>| -> mixed::LayerWeights {
                        v.iter().map(|(n, q)| (n.clone(), q.dequantize())).collect()
                    };
                    vec![deq(&int8[l]), deq(&int4[l])]
                })
                .collect();
            let sens = mixed::sensitivities(&mut model, windows, &candidates, |l| {
                log(format!("mixed: sensitivity of layer {l} measured"))
            })?;
            let weights: Vec<usize> = (0..layers)
                .map(|l| {
                    LINEARS
                        .iter()
                        .map(|s| {
                            model
                                .tensor(&linear_name(l, s))
                                .map(|t| t.data.len())
                                .unwrap_or(0)
                        })
                        .sum()
                })
                .collect();
            // Storage bits per weight of a layer in `format`, scales included.
            let layer_bits = |l: usize, format: WeightFormat| -> Result<f64> {
                let mut bits = 0.0;
                for stem in LINEARS {
                    let t = model.tensor(&linear_name(l, stem))?;
                    let bytes =
                        format
                            .bytes_for(t.rows as u64, t.cols as u64)
                            .ok_or_else(|| {
                                crate::Error::Invalid(format!(
                                    "{stem} of layer {l} does not fit {format}"
                                ))
                            })?;
                    bits += bytes as f64 * 8.0;
                }
                Ok(bits / weights[l] as f64)
            };
            let int4_format = format_of(s4, false)?;
            let choices: Vec<Vec<Choice>> = sens
                .iter()
                .enumerate()
                .map(|(l, kl)| {
                    Ok(vec![
                        Choice {
                            precision: Precision::F16,
                            bits: layer_bits(l, WeightFormat::F16)?,
                            loss: 0.0,
                        },
                        Choice {
                            precision: Precision::Int8,
                            bits: layer_bits(l, WeightFormat::Int8PerChannel)?,
                            loss: kl[0],
                        },
                        Choice {
                            precision: Precision::Int4,
                            bits: layer_bits(l, int4_format)?,
                            loss: kl[1],
                        },
                    ])
                })
                .collect::<Result<_>>()?;
            let picked = mixed::plan(&choices, &weights, opts.budget_bits.expect("checked"))?;
            let total: usize = weights.iter().sum();
            let used: f64 = picked
                .iter()
                .zip(&choices)
                .zip(&weights)
                .map(|((&k, c), &w)| c[k].bits * w as f64)
                .sum();
            metadata.push((
                "quantization.budget_bits".into(),
                format!("{}", opts.budget_bits.unwrap_or(0.0)),
            ));
            metadata.push((
                "quantization.plan_bits".into(),
                format!("{:.3}", used / total as f64),
            ));
            for (l, (&k, kl)) in picked.iter().zip(&sens).enumerate() {
                let precision = choices[l][k].precision;
                let line = format!(
                    "layer {l}: {} (KL if INT8 {:.2e}, if INT4 {:.2e})",
                    precision.name(),
                    kl[0],
                    kl[1]
                );
                metadata.push((format!("quantization.layer.{l}"), line.clone()));
                report.push(line);
                let chosen = match precision {
                    Precision::F16 => None,
                    Precision::Int8 => Some(std::mem::take(&mut int8[l])),
                    Precision::Int4 => Some(std::mem::take(&mut int4[l])),
                };
                match chosen {
                    None => {
                        for stem in LINEARS {
                            let name = linear_name(l, stem);
                            encoded.insert(
                                name.clone(),
                                Encoded::Float(linear_weights(&model, &name)?.0),
                            );
                        }
                    }
                    Some(qs) => {
                        for (name, q) in qs {
                            let f = format_of(q.scheme, false)?;
                            encoded.insert(name, Encoded::Quantized(q, f));
                        }
                    }
                }
            }
            report.push(format!(
                "plan: {:.3} bits per weight (budget {})",
                used / total as f64,
                opts.budget_bits.unwrap_or(0.0)
            ));
        }
    }
    let mut tensors = Vec::new();
    for info in files.tensors.tensors() {
        let t = model.tensor(&info.name)?;
        let (format, data) = match encoded.remove(&info.name) {
            Some(Encoded::Quantized(q, format)) => (format, encode_matrix(&q, format)?),
            Some(Encoded::Float(w)) => (WeightFormat::F16, quantize_row(WeightFormat::F16, &w)),
            None if opts.method == Method::F16 && t.rows > 1 => {
                (WeightFormat::F16, quantize_row(WeightFormat::F16, &t.data))
            }
            // Folded smoothing factors changed this vector.
            None if files
                .tensors
                .view(&info.name)
                .is_some_and(|v| v.to_f32() != t.data) =>
            {
                (WeightFormat::F32, quantize_row(WeightFormat::F32, &t.data))
            }
            None => continue,
        };
        tensors.push(OutputTensor {
            name: info.name.clone(),
            format,
            rows: t.rows,
            cols: t.cols,
            data,
        });
    }
    Ok(QuantizedModel {
        tensors,
        metadata,
        report,
    })
}
