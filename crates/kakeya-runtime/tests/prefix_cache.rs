//! The prefix cache: a session forked from a cached sequence and continued gives bit for bit
//! what a fresh session gives the whole prompt (logits, and the drafter's compact store), on a
//! tiny model that computes every row on its own (Q8_0 blocks, as the real GGUF) and on the
//! real default model; a ring that already dropped what a prefix needs is not forked; the
//! budget evicts the least recently used; the cache stays off where it would change numbers.

mod common;

use burn::tensor::Device;
use kakeya_models::testing::{
    drafter_config, random_checkpoint, random_drafter, random_quantized_checkpoint, tiny_config,
};
use kakeya_models::{DFlashDrafter, GemmaModel, KvPart};
use kakeya_runtime::{KvMode, KvPolicy, KvSetup, PrefixCache, Session};

/// The tiny model's sliding window: short, so that rings wrap.
const WINDOW: usize = 8;

fn quantized(window: usize) -> GemmaModel {
    GemmaModel::from_checkpoint(
        random_quantized_checkpoint(&tiny_config(window), 7),
        &Device::flex(),
    )
    .unwrap()
}

fn drafter(v: &GemmaModel) -> DFlashDrafter {
    DFlashDrafter::from_checkpoint(random_drafter(&drafter_config(&v.config, 1, 4), 3), v).unwrap()
}

fn ids(seed: usize, n: usize) -> Vec<u32> {
    (0..n)
        .map(|i| ((i * 37 + seed * 11 + 5) % 97) as u32)
        .collect()
}

/// Runs `tokens` after what `s` holds (chunks of `chunk`), then greedy-decodes `steps`
/// tokens; returns every logits row seen and the tokens the session then holds (the last
/// logits' choice is not run).
fn run(
    s: &mut Session<'_>,
    held: &[u32],
    tokens: &[u32],
    chunk: usize,
    steps: usize,
) -> (Vec<Vec<f32>>, Vec<u32>) {
    let mut seen = vec![s.run(tokens, chunk).unwrap()];
    let mut all: Vec<u32> = held.iter().chain(tokens).copied().collect();
    for _ in 0..steps {
        let last = seen.last().unwrap();
        let next = (0..last.len())
            .max_by(|&a, &b| last[a].total_cmp(&last[b]))
            .unwrap() as u32;
        all.push(next);
        seen.push(s.run(&[next], 1).unwrap());
    }
    (seen, all)
}

/// Every store row of `s`, K then V.
fn store_rows(s: &mut Session<'_>) -> Vec<f32> {
    let n = s.len();
    let store = s.store_mut().unwrap().expect("a drafter's store");
    [KvPart::K, KvPart::V]
        .into_iter()
        .flat_map(|p| {
            store
                .read_part(0..n, p)
                .unwrap()
                .into_data()
                .try_into_vec::<f32>()
                .unwrap()
        })
        .collect()
}

#[test]
fn a_forked_prefix_continues_bit_for_bit_like_a_fresh_session() {
    let v = quantized(WINDOW);
    let d = drafter(&v);
    let setup = KvSetup::full(3).drafter(&d);
    assert!(PrefixCache::applies(&v, &setup.policy));
    let mut cache = PrefixCache::new(64 << 20);

    // A first request: prompt, then 5 decoded tokens; its session goes to the cache.
    let first = ids(1, 6);
    let mut s = Session::with_kv(&v, setup).unwrap();
    let (_, held) = run(&mut s, &[], &first, 4, 5);
    assert_eq!(held.len(), s.len());
    cache.insert(&held, s);
    assert_eq!(cache.len(), 1);

    // Prompts sharing 4 … all of its positions (prompt and generated), then going elsewhere.
    for shared in [4, 6, 7, 10] {
        let mut prompt = held[..shared].to_vec();
        prompt.extend(ids(shared, 5));
        let mut forked = cache.fork(&prompt).expect("a cached prefix");
        assert_eq!(forked.len(), shared, "positions taken");
        let (got, got_tokens) = run(&mut forked, &prompt[..shared], &prompt[shared..], 3, 6);
        let mut fresh = Session::with_kv(&v, setup).unwrap();
        let (want, want_tokens) = run(&mut fresh, &[], &prompt, 5, 6);
        assert_eq!(got_tokens, want_tokens, "{shared} shared: tokens");
        assert_eq!(got, want, "{shared} shared: logits, bit for bit");
        assert_eq!(
            store_rows(&mut forked),
            store_rows(&mut fresh),
            "{shared} shared: store"
        );
    }
    // The entry itself is untouched by its forks' writes (copy on write): forking it again
    // still continues exactly.
    let prompt: Vec<u32> = held.iter().copied().chain([3, 1, 4]).collect();
    let mut again = cache.fork(&prompt).unwrap();
    assert_eq!(again.len(), held.len());
    let (got, _) = run(&mut again, &held, &prompt[held.len()..], 8, 3);
    let (want, _) = run(
        &mut Session::with_kv(&v, setup).unwrap(),
        &[],
        &prompt,
        8,
        3,
    );
    assert_eq!(got, want);

    let st = cache.stats();
    assert_eq!(
        (st.hits, st.misses, st.reused_tokens),
        (5, 0, 4 + 6 + 7 + 10 + 11)
    );
    // The whole prompt is never taken: its last token's logits pick the first new token.
    assert_eq!(cache.fork(&held[..7]).unwrap().len(), 6);
    // Too short a common prefix is not worth a fork.
    let mut other = held[..3].to_vec();
    other.extend(ids(9, 6));
    assert!(cache.fork(&other).is_none());
    assert_eq!(cache.stats().misses, 1);
}

#[test]
fn a_ring_that_dropped_the_prefix_is_not_forked_and_a_shorter_entry_serves() {
    let v = quantized(WINDOW);
    let setup = KvSetup::full(1);
    let mut cache = PrefixCache::new(64 << 20);
    // 40 positions: the sliding layers' rings (window 8) no longer hold the start.
    let long = ids(2, 40);
    let mut s = Session::with_kv(&v, setup).unwrap();
    s.run(&long, 16).unwrap();
    cache.insert(&long, s);
    let mut prompt = long[..6].to_vec();
    prompt.extend(ids(3, 4));
    assert!(
        cache.fork(&prompt).is_none(),
        "the rings cannot go back to 6"
    );
    // Near its end the ring still holds what the prefix needs.
    let mut near = long[..39].to_vec();
    near.push(1);
    assert_eq!(cache.fork(&near).unwrap().len(), 39);
    // A shorter entry with the same opening serves the short prefix.
    let mut s = Session::with_kv(&v, setup).unwrap();
    s.run(&long[..7], 16).unwrap();
    cache.insert(&long[..7], s);
    assert_eq!(
        cache.len(),
        2,
        "a prefix of an entry is a new entry, not a duplicate"
    );
    let mut forked = cache.fork(&prompt).expect("the short entry");
    assert_eq!(forked.len(), 6);
    let got = forked.run(&prompt[6..], 4).unwrap();
    let want = Session::with_kv(&v, setup)
        .unwrap()
        .run(&prompt, 4)
        .unwrap();
    assert_eq!(got, want);
}

#[test]
fn the_budget_keeps_the_most_recently_used_entries() {
    // A window longer than the sequences: every entry serves every prefix of its tokens.
    let v = quantized(64);
    let setup = KvSetup::full(1);
    let session = |toks: &[u32]| {
        let mut s = Session::with_kv(&v, setup).unwrap();
        s.run(toks, 16).unwrap();
        s
    };
    let a = ids(1, 12);
    let one = session(&a).kv_bytes().total;
    assert!(one > 0);
    let mut cache = PrefixCache::new(2 * one);
    cache.insert(&a, session(&a));
    let b = ids(2, 12);
    cache.insert(&b, session(&b));
    assert_eq!((cache.len(), cache.bytes()), (2, 2 * one));
    // A hit on `a` makes `b` the least recently used: a third entry evicts `b`.
    let mut pa = a[..10].to_vec();
    pa.push(0);
    assert!(cache.fork(&pa).is_some());
    let c = ids(3, 12);
    cache.insert(&c, session(&c));
    assert_eq!(cache.len(), 2);
    assert!(cache.bytes() <= 2 * one);
    assert_eq!(cache.stats().evictions, 1);
    let mut pb = b[..10].to_vec();
    pb.push(0);
    assert!(cache.fork(&pb).is_none(), "b was evicted");
    assert!(cache.fork(&pa).is_some(), "a stays");
    // An entry a new sequence extends is replaced by it; one that covers it stays as is.
    let mut longer = c.clone();
    longer.extend(ids(4, 4));
    cache.insert(&longer, session(&longer));
    assert_eq!(cache.len(), 2);
    let mut pc = longer.clone();
    pc.push(0);
    assert_eq!(cache.fork(&pc).unwrap().len(), longer.len());
    cache.insert(&c[..8], session(&c[..8]));
    assert_eq!(cache.len(), 2, "covered by the longer entry");
    // An entry larger than the whole budget is not kept.
    let mut tiny = PrefixCache::new(one / 2);
    tiny.insert(&a, session(&a));
    assert!(tiny.is_empty());
}

#[test]
fn the_cache_is_off_where_a_fork_could_change_numbers() {
    let q = quantized(WINDOW);
    assert!(PrefixCache::applies(&q, &KvPolicy::default()));
    // A bounded mode demotes positions as chunks arrive: where the prompt was cut matters.
    assert!(!PrefixCache::applies(
        &q,
        &KvPolicy::new(KvMode::SinkWindow)
    ));
    // Dense weights go through a GEMM whose sums depend on the chunk's rows.
    let dense =
        GemmaModel::from_checkpoint(random_checkpoint(&tiny_config(WINDOW), 7), &Device::flex())
            .unwrap();
    assert!(!PrefixCache::applies(&dense, &KvPolicy::default()));
}

#[test]
#[ignore = "real model: run with --include-ignored"]
fn real_model_prompts_sharing_an_opening_continue_exactly_from_the_cache() {
    let (v, tok) = common::load();
    let setup = KvSetup::full(7);
    assert!(PrefixCache::applies(&v, &setup.policy));
    let mut cache = PrefixCache::new(256 << 20);
    let opening = "You are a careful assistant. Answer in one short paragraph.\n\nQuestion: ";
    let prompt = |q: &str| {
        let mut p = vec![tok.bos];
        p.extend(tok.encode(&format!("{opening}{q}\nAnswer:")).unwrap());
        p
    };
    let first = prompt("why do cats purr?");
    let mut s = Session::with_kv(&v, setup).unwrap();
    let (_, held) = run(&mut s, &[], &first, 512, 8);
    cache.insert(&held, s);
    for q in ["how do tides work?", "what is a prime number?"] {
        let p = prompt(q);
        let mut forked = cache.fork(&p).expect("the shared opening");
        let n = forked.len();
        assert!(n >= 10 && n < p.len(), "{n} of {} positions", p.len());
        let (got, got_tokens) = run(&mut forked, &p[..n], &p[n..], 512, 16);
        let (want, want_tokens) = run(&mut Session::with_kv(&v, setup).unwrap(), &[], &p, 512, 16);
        assert_eq!(got_tokens, want_tokens, "{q}");
        assert_eq!(got, want, "{q}: logits, bit for bit");
    }
}
