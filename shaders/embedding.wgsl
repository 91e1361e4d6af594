// Embedding lookup: OUT[t, :] = TABLE[TOKENS[t], :] as f32, for a table in
// any weight format. The generator places the format's decoder
// (shaders/matmul_FORMAT.wgsl: binding 1 `W`, `decode4`) before this file.
// Tables larger than the storage binding limit are split by rows; each
// dispatch covers rows `row_start .. row_start + chunk_rows` and writes only
// the tokens that fall in it. Tokens outside the table leave their row untouched.
// One thread per 4-value piece of an output row.

struct Params {
    rows: u32,
    cols: u32,
    row_start: u32,
    chunk_rows: u32,
}

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(2) var<storage, read> TOKENS: array<u32>;
@group(0) @binding(3) var<storage, read_write> OUT: array<f32>;

const WG: u32 = 64u;

@compute @workgroup_size(WG)
fn main(ids: Ids, group: Group) {
    let pieces = (P.cols + 3u) / 4u;
    let i = group_index(group) * WG + ids.lid;
    if i >= P.rows * pieces {
        return;
    }
    let t = i / pieces;
    let piece = i % pieces;
    let token = TOKENS[t];
    if token < P.row_start || token - P.row_start >= P.chunk_rows {
        return;
    }
    let v = decode4(token - P.row_start, piece, P.cols);
    for (var j = 0u; j < 4u; j++) {
        let c = 4u * piece + j;
        if c < P.cols {
            OUT[t * P.cols + c] = v[j];
        }
    }
}
