//! The engine on whichever backend opened, and the model's tokenizer; each
//! engine step reads its results back without blocking (the browser allows
//! no blocking wait on the main thread, and a worker gains nothing by one).

use tandem_core::engine::{Engine, ReadValues, Readback, Request, TokenEvent};
use tandem_core::kv::{EvictionConfig, SeqId};
use tandem_core::sched::SamplingParams;
use tandem_core::tokenizer::{StreamDecoder, Tokenizer};
use tandem_core::Backend;
use tandem_cpu::CpuBackend;
use tandem_wgpu::WgpuBackend;

pub struct Runtime {
    pub engine: AnyEngine,
    pub tokenizer: Tokenizer,
}

pub enum AnyEngine {
    WebGpu(Box<Engine<WgpuBackend>>),
    Cpu(Box<Engine<CpuBackend>>),
}

impl AnyEngine {
    pub fn name(&self) -> &'static str {
        match self {
            AnyEngine::WebGpu(_) => "webgpu",
            AnyEngine::Cpu(_) => "cpu",
        }
    }

    pub fn kv_bytes_per_token(&self) -> usize {
        match self {
            AnyEngine::WebGpu(e) => e.kv_bytes_per_token(),
            AnyEngine::Cpu(e) => e.kv_bytes_per_token(),
        }
    }
}

impl Runtime {
    pub fn start(
        &mut self,
        prompt: Vec<u32>,
        params: SamplingParams,
        max_tokens: usize,
        kv_eviction: Option<EvictionConfig>,
    ) -> tandem_core::Result<SeqId> {
        let request = Request {
            stop_tokens: self.tokenizer.eos_tokens().to_vec(),
            kv_eviction,
            ..Request::new(prompt, params, max_tokens)
        };
        match &mut self.engine {
            AnyEngine::WebGpu(e) => e.add(request),
            AnyEngine::Cpu(e) => e.add(request),
        }
    }

    pub fn is_finished(&self, seq: SeqId) -> bool {
        match &self.engine {
            AnyEngine::WebGpu(e) => e.is_finished(seq),
            AnyEngine::Cpu(e) => e.is_finished(seq),
        }
    }

    pub fn remove(&mut self, seq: SeqId) {
        match &mut self.engine {
            AnyEngine::WebGpu(e) => e.remove(seq),
            AnyEngine::Cpu(e) => e.remove(seq),
        }
    }

    pub async fn step(&mut self) -> tandem_core::Result<Vec<TokenEvent>> {
        match &mut self.engine {
            AnyEngine::WebGpu(e) => step_without_blocking(e).await,
            AnyEngine::Cpu(e) => step_without_blocking(e).await,
        }
    }

    pub fn push_token(
        &self,
        decoder: &mut StreamDecoder,
        token: u32,
    ) -> Result<Option<String>, String> {
        decoder
            .push(&self.tokenizer, token)
            .map_err(|e| e.to_string())
    }

    pub fn finish_text(&self, decoder: &mut StreamDecoder) -> Result<Option<String>, String> {
        decoder.finish(&self.tokenizer).map_err(|e| e.to_string())
    }
}

/// One engine step whose results are read back without blocking.
async fn step_without_blocking<B: AsyncReadback>(
    engine: &mut Engine<B>,
) -> tandem_core::Result<Vec<TokenEvent>> {
    let pending = engine.begin_step()?;
    match engine.backend().read(pending.readback()).await {
        Ok(values) => Ok(engine.finish_step(pending, values)?),
        Err(e) => Err(engine.fail_step(pending, e).into()),
    }
}

/// Reading a step's results back from the device the way the browser allows.
trait AsyncReadback: Backend + Sized {
    async fn read(&self, readback: &Readback<Self>) -> tandem_core::Result<ReadValues>;
}

impl AsyncReadback for WgpuBackend {
    async fn read(&self, readback: &Readback<Self>) -> tandem_core::Result<ReadValues> {
        Ok(match readback {
            Readback::Nothing => ReadValues::Nothing,
            Readback::Logits { tensor, len } => {
                ReadValues::Logits(self.download_async(tensor, *len).await?)
            }
            Readback::TokenIds { ids, len } => {
                ReadValues::TokenIds(self.download_indices_async(ids, *len).await?)
            }
        })
    }
}

/// Host memory: the synchronous downloads are plain copies.
impl AsyncReadback for CpuBackend {
    async fn read(&self, readback: &Readback<Self>) -> tandem_core::Result<ReadValues> {
        Ok(match readback {
            Readback::Nothing => ReadValues::Nothing,
            Readback::Logits { tensor, len } => ReadValues::Logits(self.download(tensor, *len)?),
            Readback::TokenIds { ids, len } => {
                ReadValues::TokenIds(self.download_indices(ids, *len)?)
            }
        })
    }
}
