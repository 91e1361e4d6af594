//! `--speculate`, `--draft-k` and `--cascade`: turning a user's choice of
//! speculative decoding into a proposer on the engine.

use anyhow::{bail, Context, Result};
use clap::Args;
use tandem_core::backend::KvDtype;
use tandem_core::engine::Engine;
use tandem_core::kv::{KvPlan, KvShape};
use tandem_core::model::ModelFiles;
use tandem_core::spec::{
    choose_self_draft, parse_layers, self_draft_candidates, sparse::DEFAULT_SPARSE_BLOCKS,
    DraftLength, DraftModel, DraftModelConfig, EagleDraft, NgramProposer, Proposer, SparseDraft,
};
use tandem_core::Backend;

use crate::model_path;

/// English text the `self:auto` choice is measured on (teacher forced).
const SELF_AUTO_SAMPLE: &str = "The history of science is the study of how people came to \
understand the natural world. Early astronomers watched the sky and recorded the motion of the \
planets; later, careful experiments with light, motion and heat showed that simple laws describe \
a great many things. Each generation built on the work of the last, and the questions that were \
left open became the starting points of new research.";

/// Longest draft the adaptive controller may choose.
const MAX_ADAPTIVE_K: usize = 8;

#[derive(Args, Clone, Debug, Default)]
pub struct SpeculationArgs {
    /// Speculative decoding: `ngram` (prompt lookup), `draft:MODEL` (a
    /// smaller model with the same tokenizer: a path, a named model such as
    /// `qwen2.5-0.5b`, or `hf:ORG/REPO[:QUANT]`; or an EAGLE head from
    /// `tandem distill --kind eagle`, which drafts from this model's hidden
    /// states), `self:auto` or `self:LAYERS`
    /// (this model with only some layers, e.g. `self:0-9,29`), `sparse` or
    /// `sparse:BLOCKS` (this model attending only to the BLOCKS KV blocks
    /// per KV head whose keys could score highest, default 16, plus the
    /// first block and the last four; CPU backend).
    #[arg(long, value_name = "METHOD")]
    pub speculate: Option<String>,
    /// Draft tokens per step: a number, or `auto` (chosen from the measured
    /// acceptance rate and step costs, off when it does not pay).
    #[arg(long, value_name = "K|auto", default_value = "auto")]
    pub draft_k: String,
    /// Multi-level drafting, cheapest first: `ngram,draft:PATH`,
    /// `ngram,self:auto|LAYERS` or `ngram,sparse[:BLOCKS]` (n-gram drafts
    /// for the draft model).
    #[arg(long, value_name = "LEVELS", conflicts_with = "speculate")]
    pub cascade: Option<String>,
}

/// A model-based draft level.
enum DraftSource {
    /// Another model, loaded and checked to tokenize like the target.
    File(Box<ModelFiles>),
    SelfAuto,
    SelfLayers(Vec<usize>),
}

/// What drafts: `--speculate`'s method, or a cascade's second level.
enum Method {
    Ngram,
    Model(DraftSource),
    /// The target itself over this many selected KV blocks per KV head.
    Sparse(usize),
}

/// `--speculate`/`--cascade` parsed against the target, a draft model's
/// files loaded: what the KV memory is shared with, and then the proposer.
pub struct Speculation {
    method: Method,
    cascade: bool,
    length: DraftLength,
}

impl SpeculationArgs {
    pub fn is_on(&self) -> bool {
        self.speculate.is_some() || self.cascade.is_some()
    }

    fn draft_length(&self) -> Result<DraftLength> {
        if self.draft_k == "auto" {
            return Ok(DraftLength::Adaptive {
                max: MAX_ADAPTIVE_K,
            });
        }
        match self.draft_k.parse::<usize>() {
            Ok(k) if (1..=64).contains(&k) => Ok(DraftLength::Fixed(k)),
            _ => bail!(
                "--draft-k must be a number from 1 to 64 or `auto`, not `{}`",
                self.draft_k
            ),
        }
    }

    /// Sets up speculation on `engine` for the target `files` and prints
    /// what was chosen to stderr. Does nothing without `--speculate`/`--cascade`.
    pub fn attach<B: Backend>(&self, engine: &mut Engine<B>, files: &ModelFiles) -> Result<()> {
        match self.parse(files)? {
            Some(speculation) => speculation.attach(engine, files),
            None => Ok(()),
        }
    }

    /// The speculation asked for, `None` without `--speculate`/`--cascade`.
    pub fn parse(&self, files: &ModelFiles) -> Result<Option<Speculation>> {
        let length = self.draft_length()?;
        let (method, cascade) = match (&self.speculate, &self.cascade) {
            (Some(m), None) => (m.as_str(), false),
            (None, Some(levels)) => match levels.split_once(',') {
                Some(("ngram", rest)) if !rest.contains(',') => (rest, true),
                _ => bail!(
                    "--cascade takes `ngram,draft:PATH`, `ngram,self:auto|LAYERS` or `ngram,sparse[:BLOCKS]`, not `{levels}`"
                ),
            },
            _ => return Ok(None),
        };
        let method = match method.split_once(':') {
            None if method == "ngram" && !cascade => Method::Ngram,
            Some(("draft", path)) if !path.is_empty() => {
                Method::Model(DraftSource::File(Box::new(load_draft(files, path)?)))
            }
            Some(("self", "auto")) => Method::Model(DraftSource::SelfAuto),
            Some(("self", layers)) if !layers.is_empty() => Method::Model(
                DraftSource::SelfLayers(parse_layers(layers, files.config.num_layers)?),
            ),
            None if method == "sparse" => Method::Sparse(DEFAULT_SPARSE_BLOCKS),
            Some(("sparse", blocks)) => match blocks.parse::<usize>() {
                Ok(n) if n > 0 => Method::Sparse(n),
                _ => bail!("sparse:BLOCKS takes a positive number of KV blocks, not `{blocks}`"),
            },
            _ => bail!(
                "unknown speculation method `{method}`: use ngram, draft:PATH, self:auto, self:LAYERS or sparse[:BLOCKS]"
            ),
        };
        Ok(Some(Speculation {
            method,
            cascade,
            length,
        }))
    }
}

impl Speculation {
    /// Bytes of KV memory that each of the target's KV blocks brings with
    /// it: the key bounds of sparse drafting (every layer's, per block), or
    /// a draft model's own cache, which holds as many tokens as the
    /// target's in `draft_dtype` (for `self:auto`, the largest subset it
    /// may pick).
    pub fn kv_bytes_per_target_block(
        &self,
        files: &ModelFiles,
        block_size: usize,
        draft_dtype: KvDtype,
    ) -> usize {
        let config = &files.config;
        let draft_layers =
            |layers: usize, shape: KvShape| KvPlan::uniform(draft_dtype, layers).block_bytes(shape);
        match &self.method {
            Method::Ngram => 0,
            Method::Sparse(_) => config.key_bounds_block_bytes(block_size),
            Method::Model(DraftSource::File(draft)) => {
                draft_layers(draft.config.num_layers, draft.config.kv_shape(block_size))
            }
            Method::Model(DraftSource::SelfLayers(layers)) => {
                draft_layers(layers.len(), config.kv_shape(block_size))
            }
            Method::Model(DraftSource::SelfAuto) => {
                let most = self_draft_candidates(config.num_layers)
                    .iter()
                    .map(Vec::len)
                    .max()
                    .unwrap_or(0);
                draft_layers(most, config.kv_shape(block_size))
            }
        }
    }

    /// Sets up speculation on `engine` for the target `files` and prints
    /// what was chosen to stderr.
    pub fn attach<B: Backend>(self, engine: &mut Engine<B>, files: &ModelFiles) -> Result<()> {
        let Speculation {
            method,
            cascade,
            length,
        } = self;
        let proposer: Box<dyn Proposer<B>> = match method {
            Method::Ngram => Box::new(NgramProposer::default()),
            Method::Sparse(blocks) => {
                let draft = SparseDraft::new(blocks)?;
                match cascade {
                    true => Box::new(draft.with_cascade(NgramProposer::default())),
                    false => Box::new(draft),
                }
            }
            Method::Model(source) => {
                let config = draft_config(engine, cascade);
                draft_model(engine, files, source, config, length)?
            }
        };
        eprint_line!(
            "speculation: {} drafts, k {}",
            proposer.describe(),
            match length {
                DraftLength::Fixed(k) => k.to_string(),
                DraftLength::Adaptive { .. } => "auto".into(),
            }
        );
        engine.set_speculation(proposer, length)?;
        let bounds = engine.key_bounds_bytes_per_token();
        if bounds > 0 {
            eprint_line!(
                "speculation: key bounds of every KV block, {bounds} bytes per token beside the KV cache's {}",
                engine.kv_bytes_per_token()
            );
        }
        Ok(())
    }
}

fn draft_config<B: Backend>(engine: &Engine<B>, cascade: bool) -> DraftModelConfig {
    let kv = engine.kv_manager();
    DraftModelConfig {
        block_size: kv.block_size(),
        capacity_tokens: kv.num_blocks() * kv.block_size(),
        // A draft of other depth cannot take the target's per-layer
        // plan: a plan's drafts store INT8.
        kv_dtype: engine.config().kv_precision.representative_dtype(),
        max_batch_tokens: engine.config().max_batch_tokens,
        cascade: cascade.then(NgramProposer::default),
    }
}

/// The draft model of `draft:PATH`, checked against the target's tokenizer.
fn load_draft(target: &ModelFiles, path: &str) -> Result<ModelFiles> {
    let path = model_path::resolve(Some(path))?;
    let draft = tandem_core::model::load(&path)
        .with_context(|| format!("loading the draft model {}", path.display()))?;
    check_same_tokenizer(target, &draft)?;
    Ok(draft)
}

fn draft_model<B: Backend>(
    engine: &mut Engine<B>,
    files: &ModelFiles,
    source: DraftSource,
    config: DraftModelConfig,
    length: DraftLength,
) -> Result<Box<dyn Proposer<B>>> {
    match source {
        DraftSource::File(draft) if draft.config.reads_hidden => {
            let hidden = engine.model().config.hidden_size;
            let head = EagleDraft::load(engine.backend(), &draft, hidden, config)?;
            Ok(Box::new(head))
        }
        DraftSource::File(draft) => Ok(Box::new(DraftModel::load(
            engine.backend(),
            &draft,
            None,
            config,
        )?)),
        DraftSource::SelfLayers(layers) => Ok(Box::new(DraftModel::load(
            engine.backend(),
            files,
            Some(&layers),
            config,
        )?)),
        DraftSource::SelfAuto => {
            let sample = files.tokenizer.encode(SELF_AUTO_SAMPLE, false)?;
            let max_k = match length {
                DraftLength::Fixed(k) => k,
                DraftLength::Adaptive { max } => max,
            };
            let (draft, report) = choose_self_draft(engine, files, &sample, config, max_k)?;
            for c in &report {
                eprint_line!(
                    "self:auto: {} layers: agreement {:.1}%, cost {:.2} of the model, estimated speedup {:.2}x at k {}",
                    c.layers.len(),
                    100.0 * c.agreement,
                    c.cost,
                    c.speedup,
                    c.k
                );
            }
            if report.iter().all(|c| c.speedup < 1.0) {
                eprint_line!(
                    "self:auto: no layer subset is expected to pay on this model and device; \
                     with --draft-k auto speculation stays off until it measures otherwise"
                );
            }
            Ok(Box::new(draft))
        }
    }
}

/// A draft must tokenize like the target, or its proposals mean nothing.
fn check_same_tokenizer(target: &ModelFiles, draft: &ModelFiles) -> Result<()> {
    let (t, d) = (&target.tokenizer, &draft.tokenizer);
    if t.vocab_size() != d.vocab_size() || target.config.vocab_size != draft.config.vocab_size {
        bail!(
            "the draft model's vocabulary ({} tokens) differs from the model's ({}): a draft must share the tokenizer",
            draft.config.vocab_size,
            target.config.vocab_size
        );
    }
    if t.encode(SELF_AUTO_SAMPLE, false)? != d.encode(SELF_AUTO_SAMPLE, false)? {
        bail!("the draft model tokenizes text differently from the model: a draft must share the tokenizer");
    }
    Ok(())
}
