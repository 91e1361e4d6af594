//! `impl Backend for WgpuBackend`, kept to one line a method so that it
//! reads as the map of where each kernel's host side lives (`buffers`,
//! `rows`, `matmul`, `attention`, `moe`), sizes checked there before the
//! dispatch.

use super::*;

impl Backend for WgpuBackend {
    type Tensor = WgpuTensor;
    type Indices = WgpuIndices;
    type Weight = WgpuWeight;
    type KvCache = WgpuKvCache;

    fn info(&self) -> BackendInfo {
        self.backend_info()
    }

    fn alloc(&self, len: usize) -> Result<WgpuTensor> {
        self.alloc_zeroed(len)
    }

    fn upload(&self, data: &[f32]) -> Result<WgpuTensor> {
        self.upload_f32(data)
    }

    #[cfg(not(target_arch = "wasm32"))]
    fn download(&self, t: &WgpuTensor, len: usize) -> Result<Vec<f32>> {
        pollster::block_on(self.download_async(t, len))
    }

    #[cfg(target_arch = "wasm32")]
    fn download(&self, _t: &WgpuTensor, _len: usize) -> Result<Vec<f32>> {
        Err(backend_error(
            "the browser cannot wait for the GPU: use WgpuBackend::download_async",
        ))
    }

    fn upload_indices(&self, data: &[u32]) -> Result<WgpuIndices> {
        self.upload_u32(data)
    }

    fn write_indices(&self, dst: &mut WgpuIndices, data: &[u32]) -> Result<()> {
        self.write_u32(dst, data)
    }

    #[cfg(not(target_arch = "wasm32"))]
    fn download_indices(&self, t: &WgpuIndices, len: usize) -> Result<Vec<u32>> {
        pollster::block_on(self.download_indices_async(t, len))
    }

    #[cfg(target_arch = "wasm32")]
    fn download_indices(&self, _t: &WgpuIndices, _len: usize) -> Result<Vec<u32>> {
        Err(backend_error(
            "the browser cannot wait for the GPU: use WgpuBackend::download_indices_async",
        ))
    }

    fn upload_weight(&self, w: WeightView<'_>) -> Result<WgpuWeight> {
        self.upload_chunked(w)
    }

    fn alloc_kv_cache(&self, layout: KvCacheLayout) -> Result<WgpuKvCache> {
        self.new_kv_cache(layout)
    }

    fn copy_kv_blocks(&self, cache: &mut WgpuKvCache, pairs: &[(u32, u32)]) -> Result<()> {
        self.copy_blocks(cache, pairs)
    }

    fn supports_format(&self, _format: WeightFormat) -> bool {
        true
    }

    fn embedding(
        &self,
        table: &WgpuWeight,
        tokens: &WgpuIndices,
        rows: usize,
        out: &mut WgpuTensor,
    ) -> Result<()> {
        self.embedding_kernel(table, tokens, rows, out)
    }

    fn rms_norm(
        &self,
        x: &WgpuTensor,
        weight: &WgpuWeight,
        p: RmsNormParams,
        out: &mut WgpuTensor,
    ) -> Result<()> {
        self.rms_norm_kernel(x, weight, p, out)
    }

    fn rms_norm_residual(
        &self,
        residual: &mut WgpuTensor,
        delta: &WgpuTensor,
        weight: &WgpuWeight,
        p: RmsNormParams,
        out: &mut WgpuTensor,
    ) -> Result<()> {
        self.rms_norm_residual_kernel(residual, delta, weight, p, out)
    }

    fn matmul(
        &self,
        x: &WgpuTensor,
        w: &WgpuWeight,
        bias: Option<&WgpuWeight>,
        p: MatmulParams,
        out: &mut WgpuTensor,
    ) -> Result<()> {
        self.matmul_kernel(x, w, bias, p, out)
    }

    fn fuses_matmuls(&self) -> bool {
        true
    }

    fn matmul_rms_norm(
        &self,
        x: &WgpuTensor,
        norm: Option<NormPrologue<'_, WgpuWeight>>,
        w: &WgpuWeight,
        bias: Option<&WgpuWeight>,
        p: MatmulParams,
        outs: &mut [SplitOut<'_, WgpuTensor>],
    ) -> Result<()> {
        self.matmul_rms_norm_kernel(x, norm, w, bias, p, outs)
    }

    fn matmul_glu(
        &self,
        x: &WgpuTensor,
        norm: Option<NormPrologue<'_, WgpuWeight>>,
        w: &WgpuWeight,
        glu: Glu,
        p: MatmulParams,
        out: &mut WgpuTensor,
    ) -> Result<()> {
        self.matmul_glu_kernel(x, norm, w, glu, p, out)
    }

    fn matmul_residual(
        &self,
        x: &WgpuTensor,
        w: &WgpuWeight,
        p: MatmulParams,
        out: &mut WgpuTensor,
    ) -> Result<()> {
        self.matmul_residual_kernel(x, w, p, out)
    }

    fn kernel_launches(&self) -> Option<u64> {
        Some(self.gpu.launches())
    }

    fn rope(
        &self,
        x: &mut WgpuTensor,
        positions: &WgpuIndices,
        inv_freq: &WgpuTensor,
        p: RopeParams,
    ) -> Result<()> {
        self.rope_kernel(x, positions, inv_freq, p)
    }

    fn paged_kv_write(
        &self,
        k: &WgpuTensor,
        v: &WgpuTensor,
        slots: &WgpuIndices,
        rows: usize,
        cache: &mut WgpuKvCache,
    ) -> Result<()> {
        self.paged_kv_write_kernel(k, v, slots, rows, cache)
    }

    fn track_key_bounds(&self, cache: &mut WgpuKvCache) -> Result<()> {
        self.alloc_key_bounds(cache)
    }

    fn select_kv_blocks(
        &self,
        q: &WgpuTensor,
        cache: &WgpuKvCache,
        idx: AttentionIndices<'_, Self>,
        p: AttentionParams,
        select: BlockSelectParams,
        out: &mut WgpuIndices,
    ) -> Result<()> {
        self.select_kv_blocks_kernel(q, cache, idx, p, select, out)
    }

    fn paged_attention(
        &self,
        q: &WgpuTensor,
        cache: &WgpuKvCache,
        idx: AttentionIndices<'_, Self>,
        p: AttentionParams,
        out: &mut WgpuTensor,
    ) -> Result<()> {
        self.attention_kernel(q, cache, idx, p, out, false)
    }

    fn paged_attention_scores(
        &self,
        q: &WgpuTensor,
        cache: &WgpuKvCache,
        idx: AttentionIndices<'_, Self>,
        p: AttentionParams,
        scores: &mut WgpuTensor,
    ) -> Result<()> {
        self.attention_scores_kernel(q, cache, idx, p, scores)
    }

    fn swiglu(
        &self,
        gate: &WgpuTensor,
        up: &WgpuTensor,
        len: usize,
        out: &mut WgpuTensor,
    ) -> Result<()> {
        self.gated_product("swiglu", gate, up, len, out)
    }

    fn geglu(
        &self,
        gate: &WgpuTensor,
        up: &WgpuTensor,
        len: usize,
        out: &mut WgpuTensor,
    ) -> Result<()> {
        self.gated_product("geglu", gate, up, len, out)
    }

    fn scale(&self, x: &mut WgpuTensor, len: usize, factor: f32) -> Result<()> {
        self.scale_kernel(x, len, factor)
    }

    fn gather_rows(
        &self,
        x: &WgpuTensor,
        rows: &WgpuIndices,
        n: usize,
        width: usize,
        out: &mut WgpuTensor,
    ) -> Result<()> {
        self.gather_rows_kernel(x, rows, n, width, out)
    }

    fn moe_route(
        &self,
        logits: &WgpuTensor,
        p: MoeRouteParams,
        ids: &mut WgpuIndices,
        weights: &mut WgpuTensor,
    ) -> Result<()> {
        self.moe_route_kernel(logits, p, ids, weights)
    }

    fn moe_combine(
        &self,
        y: &WgpuTensor,
        rows: &WgpuIndices,
        ids: &WgpuIndices,
        weights: &WgpuTensor,
        p: MoeCombineParams,
        out: &mut WgpuTensor,
    ) -> Result<()> {
        self.moe_combine_kernel(y, rows, ids, weights, p, out)
    }

    fn argmax(
        &self,
        x: &WgpuTensor,
        rows: usize,
        width: usize,
        out: &mut WgpuIndices,
    ) -> Result<()> {
        self.argmax_kernel(x, rows, width, out)
    }
}
