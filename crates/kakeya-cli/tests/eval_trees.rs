//! `kakeya eval trees` on a tiny random model and drafter: the report, the chain it counts
//! against the engine's own, trees within their candidates' ceiling, bad budgets refused.

mod common;

use common::{fails, run_ok, tiny_model_dir};
use kakeya_models::testing::{Scratch, drafter_config, random_drafter, tiny_config};

#[test]
fn eval_trees_counts_chains_and_trees_per_budget() {
    let s = Scratch::new("cli-eval-trees");
    let m = tiny_model_dir(&s.0, "model", 32, 3);
    let d = s.0.join("drafter");
    random_drafter(&drafter_config(&tiny_config(32), 2, 4), 4)
        .write_dir(&d)
        .unwrap();
    let prompts = s.0.join("p.jsonl");
    std::fs::write(
        &prompts,
        "{\"text\": \"w5 w6 w7 w5 w6\"}\n{\"text\": \"w9 w10 w11\"}\n",
    )
    .unwrap();
    let args = |budgets: &str| {
        vec![
            "eval".to_string(),
            "trees".into(),
            "--model".into(),
            m.to_str().unwrap().into(),
            "--drafter".into(),
            d.to_str().unwrap().into(),
            "--prompts".into(),
            prompts.to_str().unwrap().into(),
            "--gen-tokens".into(),
            "24".into(),
            "--block-size".into(),
            "4".into(),
            "--budgets".into(),
            budgets.into(),
            "--json".into(),
        ]
    };
    let a = args("4,2,8");
    let j: serde_json::Value =
        serde_json::from_str(&run_ok(&a.iter().map(String::as_str).collect::<Vec<_>>())).unwrap();
    assert_eq!(j["prompts"], 2);
    let budgets = j["budgets"].as_array().unwrap();
    let rows: Vec<u64> = budgets
        .iter()
        .map(|b| b["rows"].as_u64().unwrap())
        .collect();
    assert_eq!(rows, vec![2, 4, 8], "sorted");
    let per = |b: &serde_json::Value, k: &str| {
        b[k]["tokens"].as_f64().unwrap() / b["blocks"].as_f64().unwrap()
    };
    for b in budgets {
        let r = b["rows"].as_f64().unwrap();
        assert!(b["blocks"].as_u64().unwrap() > 0);
        for k in [
            "chain",
            "tree",
            "candidates_ceiling",
            "drafter_chain",
            "drafter_tree",
        ] {
            let t = per(b, k);
            assert!((1.0..=r).contains(&t), "{k} at {r} rows: {t}");
            let used = b[k]["rows"].as_f64().unwrap() / b["blocks"].as_f64().unwrap();
            assert!(used <= r, "{k} uses at most its budget: {used}");
        }
        assert!(per(b, "tree") <= per(b, "candidates_ceiling"));
    }
    // The chain of the engine's block length is the chain the engine verified (the blocks it
    // ran without drafts, one token each, are not probed).
    let unprobed = j["engine_blocks"].as_u64().unwrap() - budgets[1]["blocks"].as_u64().unwrap();
    assert_eq!(
        budgets[1]["chain"]["tokens"].as_u64().unwrap() + unprobed,
        j["engine_tokens"].as_u64().unwrap(),
        "{j}"
    );

    let bad = args("4,0");
    let err = fails(&bad.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(err.contains("--budgets"), "{err}");
}
