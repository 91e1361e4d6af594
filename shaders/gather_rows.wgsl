// OUT[i, :] = X[ROWS[i], :] for rows of `width` values (e.g. the last token of
// each sequence before the LM head). Row indices past `src_rows` leave their
// output row untouched. One thread per output element.

struct Params {
    n: u32,
    width: u32,
    src_rows: u32,
}

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<storage, read> X: array<f32>;
@group(0) @binding(2) var<storage, read> ROWS: array<u32>;
@group(0) @binding(3) var<storage, read_write> OUT: array<f32>;

const WG: u32 = 256u;

@compute @workgroup_size(WG)
fn main(ids: Ids, group: Group) {
    let i = group_index(group) * WG + ids.lid;
    if i >= P.n * P.width {
        return;
    }
    let src = ROWS[i / P.width];
    if src >= P.src_rows {
        return;
    }
    OUT[i] = X[src * P.width + i % P.width];
}
