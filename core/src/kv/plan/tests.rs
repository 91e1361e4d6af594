use proptest::prelude::*;

use super::*;

const SHAPE: KvShape = KvShape {
    kv_heads: 3,
    head_dim: 64,
    block_size: 16,
};

/// Losses of INT8, INT4 and INT2 against INT8; a cheaper dtype may lose
/// less (per-channel keys against INT8's per-token ones).
fn losses() -> impl Strategy<Value = [f64; 3]> {
    (-0.5..1.0f64, -0.5..4.0f64).prop_map(|(a, b)| [0.0, a, a + b])
}

/// The least loss of any plan within the budget, by trying them all.
fn brute_force(s: &KvSensitivity, bits: f64) -> Option<f64> {
    let layers = s.keys.len();
    let options: Vec<_> = (0..layers).map(|l| s.options(l)).collect();
    let per_layer = options[0].len();
    let mut best: Option<f64> = None;
    for code in 0..per_layer.pow(layers as u32) {
        let picks: Vec<_> = (0..layers)
            .map(|l| options[l][code / per_layer.pow(l as u32) % per_layer])
            .collect();
        let plan = KvPlan::new(picks.iter().map(|p| p.0).collect()).unwrap();
        if plan.bits_per_element(SHAPE) <= bits + 1e-9 {
            let loss: f64 = picks.iter().map(|p| p.1).sum();
            best = Some(best.map_or(loss, |b: f64| b.min(loss)));
        }
    }
    best
}

fn loss_of(plan: &KvPlan, s: &KvSensitivity) -> f64 {
    plan.layers()
        .iter()
        .enumerate()
        .map(|(l, d)| s.options(l).into_iter().find(|o| o.0 == *d).unwrap().1)
        .sum()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    /// The planner's plan fits the budget and no plan within it loses less.
    #[test]
    fn the_plan_is_the_least_loss_within_the_budget(
        keys in prop::collection::vec(losses(), 1..4),
        values in prop::collection::vec(losses(), 3),
        float in prop::collection::vec(-1.0..0.5f64, 3),
        bits in 2.5..17.0f64,
    ) {
        let layers = keys.len();
        let s = KvSensitivity {
            keys,
            values: values[..layers].to_vec(),
            float: float[..layers].to_vec(),
        };
        match (choose_plan(&s, SHAPE, bits), brute_force(&s, bits)) {
            (Ok(plan), Some(want)) => {
                prop_assert!(plan.bits_per_element(SHAPE) <= bits + 1e-9);
                prop_assert!((loss_of(&plan, &s) - want).abs() < 1e-9,
                    "{plan}: {} vs {want}", loss_of(&plan, &s));
            }
            (Err(_), None) => {}
            (got, want) => prop_assert!(false, "{got:?} vs {want:?}"),
        }
    }
}

#[test]
fn the_budget_of_uniform_int4_costs_what_uniform_int4_costs() {
    let int4 = KvPlan::uniform(KvDtype::Int4, 30);
    // SmolLM2's shape: 7920 bytes per token, as the README's KV table says.
    assert_eq!(int4.bytes_per_token(SHAPE), 7920);
    assert!((int4.bits_per_element(SHAPE) - 5.5).abs() < 1e-9);
    let s = KvSensitivity {
        keys: vec![[0.0, 1.0, 9.0]; 30],
        values: vec![[0.0, 1.0, 9.0]; 30],
        float: vec![0.0; 30],
    };
    // Equal losses everywhere: the budget of int4 buys int4.
    let plan = choose_plan(&s, SHAPE, 5.5).unwrap();
    assert_eq!(plan.uniform_dtype(), Some(KvDtype::Int4), "{plan}");
    // Sensitive keys in layer 0 take the bytes of the cheap values elsewhere.
    let mut s = s;
    s.keys[0] = [0.0, 50.0, 100.0];
    s.values = vec![[0.0, 0.01, 0.02]; 30];
    let plan = choose_plan(&s, SHAPE, 5.5).unwrap();
    assert_eq!(plan.layers()[0].keys, KvDtype::Int8, "{plan}");
    assert!(plan.bytes_per_token(SHAPE) <= 7920);
}

#[test]
fn a_budget_above_int8_buys_the_layers_where_floats_pay() {
    let s = KvSensitivity {
        keys: vec![[0.0, 1.0, 9.0]; 4],
        values: vec![[0.0, 1.0, 9.0]; 4],
        float: vec![-0.01, -2.0, -0.02, 0.001],
    };
    let int8 = KvPlan::uniform(KvDtype::Int8, 4).bits_per_element(SHAPE);
    assert_eq!(
        choose_plan(&s, SHAPE, int8).unwrap().to_string(),
        "int8/int8*4"
    );
    // Room for one float layer: the one whose INT8 cache costs most.
    let plan = choose_plan(&s, SHAPE, (3.0 * int8 + 16.0) / 4.0).unwrap();
    assert_eq!(plan.to_string(), "int8/int8,f16/f16,int8/int8*2");
    // A float layer that measures no better than INT8 is never bought.
    let plan = choose_plan(&s, SHAPE, 16.0).unwrap();
    assert_eq!(plan.to_string(), "f16/f16*3,int8/int8");
}

#[test]
fn a_budget_below_the_cheapest_plan_is_refused() {
    let s = KvSensitivity {
        keys: vec![[0.0, 1.0, 2.0]; 2],
        values: vec![[0.0, 1.0, 2.0]; 2],
        float: vec![0.0; 2],
    };
    let err = choose_plan(&s, SHAPE, 1.0).unwrap_err().to_string();
    assert!(err.contains("below the cheapest plan's 3.50"), "{err}");
    for bad in [0.0, -1.0, f64::NAN] {
        assert!(choose_plan(&s, SHAPE, bad).is_err());
    }
}

#[test]
fn a_plan_reads_back_what_it_writes() {
    let text = "int8/int4*2,int4/int2,f16/f16,int2/int8";
    let plan: KvPlan = text.parse().unwrap();
    assert_eq!(plan.num_layers(), 5);
    assert_eq!(plan.to_string(), text);
    assert_eq!(plan.layers()[1].values, KvDtype::Int4);
    let uniform = KvPlan::uniform(KvDtype::Int8, 4);
    assert_eq!(uniform.to_string(), "int8/int8*4");
    assert_eq!(uniform.to_string().parse::<KvPlan>().unwrap(), uniform);
}

#[test]
fn a_bad_plan_names_what_is_wrong() {
    for (text, says) in [
        ("int8", "is not KEYS/VALUES"),
        ("int8/int9", "unknown KV dtype `int9`"),
        ("int8/int4*0", "`0` is not a layer count"),
        ("f16/int4", "layer 0"),
        ("int8/int8,f32/f16", "layer 1"),
    ] {
        let err = text.parse::<KvPlan>().unwrap_err().to_string();
        assert!(err.contains(says), "{text}: {err}");
    }
    let plan = KvPlan::uniform(KvDtype::Int8, 3);
    assert!(plan
        .check_layers(4)
        .unwrap_err()
        .to_string()
        .contains("names 3 layers"));
}
