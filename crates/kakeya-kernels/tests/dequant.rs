//! Dequantisation of every supported GGML format against the PyPI `gguf` package's own
//! dequantiser, on real blocks of the default model (or blocks `gguf` quantised from real
//! weights). Fixture and generator: `tests/fixtures/dequant/` at the workspace root.

use kakeya_kernels::dequant::{GgmlType, dequantize};

fn fixture() -> serde_json::Value {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/fixtures/dequant/dequant.json"
    );
    serde_json::from_str(&std::fs::read_to_string(path).expect("fixture present"))
        .expect("valid JSON")
}

fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

/// Every format must agree to f32 rounding: both sides form the same f32 products of f16
/// scales and small integers, possibly in another order (`d·sc·q` vs `(d·sc)·q`, `x·d - m`), so
/// we allow 2 ulp of the block's largest magnitude.
#[test]
fn every_format_matches_gguf_py() {
    let f = fixture();
    let mut seen = Vec::new();
    for case in f["cases"].as_array().unwrap() {
        let name = case["type"].as_str().unwrap();
        let ty = GgmlType::from_id(case["type_id"].as_u64().unwrap() as u32)
            .unwrap_or_else(|| panic!("{name} unsupported"));
        let n = case["n"].as_u64().unwrap() as usize;
        let got = dequantize(ty, &hex(case["raw_hex"].as_str().unwrap()), n);
        let want: Vec<f32> = case["expected"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap() as f32)
            .collect();
        assert_eq!(got.len(), want.len());
        let scale = want.iter().fold(0.0f32, |a, w| a.max(w.abs()));
        let tol = 2.0 * f32::EPSILON * scale;
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(
                (g - w).abs() <= tol,
                "{name} element {i}: got {g}, gguf says {w}"
            );
        }
        seen.push(name.to_string());
    }
    for required in [
        "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K",
    ] {
        assert!(
            seen.iter().any(|s| s == required),
            "fixture lacks {required}"
        );
    }
}
