//! Protocol v1.8 (and v1.9's repeated-token share) through a real server: the instability signals are validated with
//! a path to what was wrong, stored as series and read back by name, combined across
//! the ranks of a multi-rank run, and the registration's `signals` is kept.

use crate::common::{TestApp, error_of};
use serde_json::{Value, json};

fn record() -> Value {
    json!({
        "step": 4, "loss": 2.5,
        "modules": [
            {"module": "model.layers.0.self_attn", "grad_norm": 0.5,
             "attn_max_logit": 112.5, "attn_min_entropy": 0.25,
             "act_rms": 1.5, "act_absmax": 48.0,
             "adam": {"updated": 4096, "below_eps": 0.75, "update_rms": 0.125, "update_absmax": 2.75}},
            {"module": "model.layers.1.self_attn", "attn_max_logit": "Infinity"}
        ],
        "output_logits": {"logz_mean": -3.5, "absmax": 21.0, "logit_mean": -12.5},
        "moe": [{"module": "model.layers.0.mlp.gate", "tokens_per_expert": [6, 2, 0, 0], "router_z": 4.5}],
        "batch": {"ids": ["shard-3:row-17", "shard-3:row-18"], "micro_losses": [2.25, 2.75],
                  "repeated_token_share": 0.375}
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_v1_8_value_reads_back_as_a_series() {
    let app = TestApp::spawn().await;
    let registration = json!({"params": [], "signals": {"attention": 1, "activations": 1,
        "adam": 10, "output_logits": 1, "moe": 1, "tokens": 1}});
    assert_eq!(app.register("r", &registration).await.status(), 201);
    let (_, run) = app.get_json("/api/v1/runs/r").await;
    assert_eq!(run["signals"], registration["signals"]);
    assert_eq!(app.post_steps("r", &json!([record()])).await.status(), 200);
    let attn = "model.layers.0.self_attn";
    let gate = "model.layers.0.mlp.gate";
    let cases = [
        (
            format!("metric=attn_max_logit&subject={attn}"),
            json!(112.5),
        ),
        (
            "metric=attn_max_logit&subject=model.layers.1.self_attn".into(),
            json!("Infinity"),
        ),
        (
            format!("metric=attn_min_entropy&subject={attn}"),
            json!(0.25),
        ),
        (format!("metric=act_rms&subject={attn}"), json!(1.5)),
        (format!("metric=act_absmax&subject={attn}"), json!(48)),
        (format!("metric=adam_updated&subject={attn}"), json!(4096)),
        (format!("metric=adam_below_eps&subject={attn}"), json!(0.75)),
        (
            format!("metric=adam_update_rms&subject={attn}"),
            json!(0.125),
        ),
        (
            format!("metric=adam_update_absmax&subject={attn}"),
            json!(2.75),
        ),
        ("metric=output_logz_mean".into(), json!(-3.5)),
        ("metric=output_logit_absmax".into(), json!(21)),
        ("metric=output_logit_mean".into(), json!(-12.5)),
        (
            format!("metric=moe_expert_tokens&subject={gate}/1"),
            json!(2),
        ),
        (format!("metric=moe_router_z&subject={gate}"), json!(4.5)),
        (format!("metric=moe_top_share&subject={gate}"), json!(0.75)),
        (format!("metric=moe_max_vio&subject={gate}"), json!(2)),
        (format!("metric=moe_idle_experts&subject={gate}"), json!(2)),
        ("metric=micro_loss&subject=1".into(), json!(2.75)),
        ("metric=repeated_token_share".into(), json!(0.375)),
    ];
    for (query, value) in cases {
        assert_eq!(app.points("r", &query).await, vec![(4, value)], "{query}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_v1_8_values_are_refused_with_their_path() {
    let app = TestApp::spawn().await;
    assert_eq!(
        app.register("r", &json!({"params": []})).await.status(),
        201
    );
    let with = |pointer: &str, value: Value| {
        let mut record = record();
        // The parent must exist; the field itself may be new (an unknown key).
        let (parent, key) = pointer.rsplit_once('/').expect(pointer);
        match record.pointer_mut(parent).expect(pointer) {
            Value::Object(fields) => {
                fields.insert(key.to_owned(), value);
            }
            Value::Array(items) => items[key.parse::<usize>().expect(pointer)] = value,
            other => panic!("{pointer}: {other} holds no field"),
        }
        json!([{"step": 1}, record])
    };
    let too_many_ids: Vec<String> = (0..1025).map(|i| format!("b{i}")).collect();
    let cases = [
        (
            with("/modules/0/adam/below_eps", json!(1.5)),
            "steps[1].modules[0].adam.below_eps",
        ),
        (
            with("/modules/0/adam/below_eps", json!("NaN")),
            "steps[1].modules[0].adam.below_eps",
        ),
        (
            with("/modules/0/adam/update_rms", json!(-0.1)),
            "steps[1].modules[0].adam.update_rms",
        ),
        (
            with("/modules/0/adam/updated", json!(-1)),
            "steps[1].modules[0].adam.updated",
        ),
        (
            with("/modules/0/act_rms", json!(-1)),
            "steps[1].modules[0].act_rms",
        ),
        (
            with("/modules/0/act_absmax", json!("-Infinity")),
            "steps[1].modules[0].act_absmax",
        ),
        (
            with("/modules/0/attn_min_entropy", json!(-0.5)),
            "steps[1].modules[0].attn_min_entropy",
        ),
        (
            with("/modules/0/adam/bogus", json!(1)),
            "steps[1].modules[0].adam",
        ),
        (
            with("/output_logits/absmax", json!(-2)),
            "steps[1].output_logits.absmax",
        ),
        (
            with("/moe/0/tokens_per_expert", json!([])),
            "steps[1].moe[0].tokens_per_expert",
        ),
        (
            with("/moe/0/tokens_per_expert", json!(vec![1; 1025])),
            "steps[1].moe[0].tokens_per_expert",
        ),
        (
            with("/moe/0/tokens_per_expert", json!([1, -2])),
            "steps[1].moe[0].tokens_per_expert",
        ),
        (
            with("/moe/0/router_z", json!(-1)),
            "steps[1].moe[0].router_z",
        ),
        (with("/moe/0/module", json!("")), "steps[1].moe[0].module"),
        (
            with("/batch/ids", json!(too_many_ids)),
            "steps[1].batch.ids",
        ),
        (
            with("/batch/ids/1", json!("x".repeat(257))),
            "steps[1].batch.ids[1]",
        ),
        (with("/batch/ids/0", json!("")), "steps[1].batch.ids[0]"),
        (
            with("/batch/micro_losses", json!(["nan"])),
            "steps[1].batch.micro_losses",
        ),
        (
            with("/batch/repeated_token_share", json!(1.5)),
            "steps[1].batch.repeated_token_share",
        ),
    ];
    for (body, path) in cases {
        let (status, error) = error_of(app.post_steps("r", &body).await).await;
        assert_eq!(status, 400, "{path}: {error}");
        assert_eq!(error["code"], "invalid_body", "{path}");
        assert!(
            error["path"].as_str().is_some_and(|p| p.starts_with(path)),
            "{path}: {error}"
        );
        assert!(!error["message"].as_str().unwrap().is_empty());
    }
    // A layer named twice, and an interval of 0 in the registration.
    let mut twice = record();
    twice["moe"] = json!([{"module": "g", "tokens_per_expert": [1]},
                          {"module": "g", "tokens_per_expert": [2]}]);
    let (status, error) = error_of(app.post_steps("r", &json!([twice])).await).await;
    assert_eq!(
        (status, &error["path"]),
        (400, &json!("steps[0].moe[1].module"))
    );
    let (status, error) = error_of(
        app.register("s", &json!({"params": [], "signals": {"adam": 0}}))
            .await,
    )
    .await;
    assert_eq!((status, &error["path"]), (400, &json!("signals.adam")));
    let (status, error) = error_of(
        app.register("s", &json!({"params": [], "signals": {"attn": 1}}))
            .await,
    )
    .await;
    assert_eq!(status, 400, "{error}");
    // Nothing of the refused batches was stored.
    assert!(app.points("r", "metric=loss").await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ranks_combine_their_signals() {
    let app = TestApp::spawn().await;
    let registration = json!({"world_size": 2, "params": [
        {"name": "model.layers.0.self_attn.q_proj.weight", "module": "model.layers.0.self_attn"}]});
    assert_eq!(app.register("m", &registration).await.status(), 201);
    let rank = |rank: u32, logit: f64, entropy: f64, tokens: [u64; 2], micro: f64| {
        json!([{"step": 0, "rank": rank, "loss": 2.0,
            "modules": [{"module": "model.layers.0.self_attn", "grad_norm": 0.5,
                         "attn_max_logit": logit, "attn_min_entropy": entropy,
                         "adam": {"updated": 10, "below_eps": 0.5, "update_rms": 0.25}}],
            "output_logits": {"logz_mean": logit / 10.0},
            "moe": [{"module": "gate", "tokens_per_expert": tokens}],
            "batch": {"micro_losses": [micro], "repeated_token_share": micro / 10.0}}])
    };
    let attn = "model.layers.0.self_attn";
    assert_eq!(
        app.post_steps("m", &rank(0, 30.0, 1.5, [3, 1], 2.0))
            .await
            .status(),
        200
    );
    assert_eq!(
        app.post_steps("m", &rank(1, 50.0, 0.5, [5, 7], 9.0))
            .await
            .status(),
        200
    );
    let cases = [
        // The extremes of what the ranks' batches did.
        (format!("metric=attn_max_logit&subject={attn}"), json!(50)),
        (
            format!("metric=attn_min_entropy&subject={attn}"),
            json!(0.5),
        ),
        ("metric=micro_loss&subject=0".into(), json!(9)),
        ("metric=repeated_token_share".into(), json!(0.9)),
        // The mean log Z.
        ("metric=output_logz_mean".into(), json!(4)),
        // Loads add up, and the summary is the sum's: 8 of 16 tokens.
        ("metric=moe_expert_tokens&subject=gate/1".into(), json!(8)),
        ("metric=moe_top_share&subject=gate".into(), json!(0.5)),
        // A replicated module's optimizer state is any rank's.
        (format!("metric=adam_updated&subject={attn}"), json!(10)),
        (
            format!("metric=adam_update_rms&subject={attn}"),
            json!(0.25),
        ),
    ];
    for (query, value) in cases {
        assert_eq!(app.points("m", &query).await, vec![(0, value)], "{query}");
    }
}
