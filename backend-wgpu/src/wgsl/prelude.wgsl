// Prelude that tandem-wgpu's shader generator (src/shader.rs) puts before
// every kernel of shaders/. The generator resolves `// #if FLAG`, `// #if !FLAG`,
// `// #else` and `// #endif` lines over the whole text. Flags: F16 (the
// adapter has shader-f16), SUBGROUPS (it has subgroup operations), and the
// per-kernel ones (weight format, KV cache type).
//
// Every kernel defines `const WG: u32`, the workgroup size of the entry points
// that call the reductions below; it is a power of two.

// Entry points take two parameters, `ids: Ids, group: Group`:
//     @compute @workgroup_size(WG)
//     fn main(ids: Ids, group: Group) { let row = group_index(group); ... }
// The split matters in the browser: Chrome's WGSL compiler (Tint) treats a
// struct parameter as non-uniform as soon as one member is, so a group index
// taken from a struct that also holds `local_invocation_index` would make
// every barrier after a bounds check on it "not in uniform control flow".
// naga does not check this; the unit tests of src/shader.rs do.

// This invocation within its workgroup (and subgroup): not uniform.
struct Ids {
    @builtin(local_invocation_index) lid: u32,
// #if SUBGROUPS
    @builtin(subgroup_invocation_id) lane: u32,
    @builtin(subgroup_size) lanes: u32,
// #endif
}

// This workgroup within the dispatch: uniform over the workgroup.
struct Group {
    @builtin(workgroup_id) id: vec3<u32>,
    @builtin(num_workgroups) count: vec3<u32>,
}

// Index of this workgroup in a 1D dispatch, or in a 2D one that the host uses
// when the count exceeds `max_compute_workgroups_per_dimension`; the host
// rounds the count up, so kernels check the index against their own bounds.
fn group_index(group: Group) -> u32 {
    return group.id.x + group.id.y * group.count.x;
}

// Where a thread sits for the workgroup reductions.
struct Lane {
    lid: u32,
    // Index within the subgroup and subgroup size (0 and 1 without subgroups).
    lane: u32,
    lanes: u32,
}

fn lane_of(ids: Ids) -> Lane {
// #if SUBGROUPS
    return Lane(ids.lid, ids.lane, ids.lanes);
// #else
    return Lane(ids.lid, 0u, 1u);
// #endif
}

var<workgroup> reduce_slots: array<f32, WG>;
// #if SUBGROUPS
var<workgroup> reduce_count: atomic<u32>;
// #endif

// Sum (or max when `is_max`) of `v` over the workgroup, returned to every
// thread. Must be called in uniform control flow. With subgroups each
// subgroup reduces in registers and its first lane claims a slot; the slot
// is claimed through an atomic so that nothing assumes how the driver lays
// subgroups over the workgroup. Without subgroups: a tree in workgroup memory.
fn reduce(v: f32, at: Lane, is_max: bool) -> f32 {
// #if SUBGROUPS
    if at.lid == 0u {
        atomicStore(&reduce_count, 0u);
    }
    workgroupBarrier();
    // Both in uniform control flow; the select keeps it that way.
    let part = select(subgroupAdd(v), subgroupMax(v), is_max);
    if at.lane == 0u {
        reduce_slots[atomicAdd(&reduce_count, 1u)] = part;
    }
    workgroupBarrier();
    var total = reduce_slots[0];
    for (var i = 1u; i < WG / at.lanes; i++) {
        if is_max {
            total = max(total, reduce_slots[i]);
        } else {
            total += reduce_slots[i];
        }
    }
    workgroupBarrier();
    return total;
// #else
    reduce_slots[at.lid] = v;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride >>= 1u) {
        if at.lid < stride {
            let other = reduce_slots[at.lid + stride];
            if is_max {
                reduce_slots[at.lid] = max(reduce_slots[at.lid], other);
            } else {
                reduce_slots[at.lid] += other;
            }
        }
        workgroupBarrier();
    }
    let total = reduce_slots[0];
    workgroupBarrier();
    return total;
// #endif
}

fn reduce_sum(v: f32, at: Lane) -> f32 {
    return reduce(v, at, false);
}

fn reduce_max(v: f32, at: Lane) -> f32 {
    return reduce(v, at, true);
}
