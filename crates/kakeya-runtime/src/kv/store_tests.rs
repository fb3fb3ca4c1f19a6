use burn::tensor::{Device, Tensor, TensorData};
use kakeya_models::DraftContext;

use super::{CompactStore, DROP_STEP, DraftReach, StoreFormat};

const W: usize = 6;

/// Rows of positions `from..from + n`, every value distinct.
fn rows(from: usize, n: usize, salt: f32) -> Tensor<2> {
    let v = (from * W..(from + n) * W)
        .map(|i| (i as f32).sin() * 3.0 + salt)
        .collect::<Vec<_>>();
    Tensor::from_data(TensorData::new(v, [n, W]), &Device::flex())
}

fn host(t: Tensor<2>) -> Vec<f32> {
    t.into_data().try_into_vec::<f32>().unwrap()
}

fn append(s: &mut CompactStore, from: usize, n: usize) {
    s.append(rows(from, n, 0.0), rows(from, n, 0.5)).unwrap();
}

/// `store`'s draft reads equal the rows of the same positions in `whole`, and are the sink's
/// and the window's positions.
fn reads_as_whole(store: &CompactStore, whole: &CompactStore, reach: DraftReach) {
    let len = store.len();
    assert_eq!(whole.len(), len);
    let (pos, k, v) = store.read_reach().unwrap();
    let want: Vec<usize> = (0..reach.sink.min(len))
        .chain(len.saturating_sub(reach.window).max(reach.sink.min(len))..len)
        .collect();
    assert_eq!(pos, want, "len {len}");
    let (wk, wv) = whole.read(0..len).unwrap();
    let pick = |all: Vec<f32>| -> Vec<f32> {
        pos.iter()
            .flat_map(|&p| all[p * W..(p + 1) * W].to_vec())
            .collect()
    };
    assert_eq!(host(k), pick(host(wk)), "K at len {len}");
    assert_eq!(host(v), pick(host(wv)), "V at len {len}");
}

#[test]
fn a_reach_keeps_the_sink_and_the_window_and_reads_them_as_the_whole_store_does() {
    let reach = DraftReach {
        sink: 3,
        window: 40,
    };
    let cap = |rows: usize| 2 * 4 * (rows * W + rows * W / 8 + 64);
    for chunks in [vec![1; 400], vec![2, 7, 64, 129, 100, 1, 1, 96], vec![400]] {
        let mut whole = CompactStore::new(W, None, &Device::flex());
        let mut part = CompactStore::with_reach(W, StoreFormat::F32, Some(reach), &Device::flex());
        let mut len = 0;
        for n in chunks {
            append(&mut whole, len, n);
            append(&mut part, len, n);
            len += n;
            reads_as_whole(&part, &whole, reach);
            // Held: the sink, the window and at most two drop steps, however long the context.
            assert!(
                part.nbytes() <= cap(reach.sink) + cap(reach.window + 2 * DROP_STEP),
                "len {len}: {} bytes",
                part.nbytes()
            );
        }
        assert!(part.nbytes() * 2 < whole.nbytes());
        // A rollback within a drop step reads what a store that never held the rows reads.
        for back in [1, 17, DROP_STEP] {
            let (mut p, mut w) = (part.clone(), whole.clone());
            p.truncate(len - back);
            w.truncate(len - back);
            reads_as_whole(&p, &w, reach);
            append(&mut p, len - back, back + 5);
            append(&mut w, len - back, back + 5);
            reads_as_whole(&p, &w, reach);
        }
        // Dropped positions are not there to read.
        let err = part.read(3..10).unwrap_err().to_string();
        assert!(err.contains("dropped"), "{err}");
        assert!(part.read(0..3).is_ok() && part.read(len - 40..len).is_ok());
    }
}

#[test]
fn truncating_past_the_dropped_rows_reads_what_is_left_and_grows_again() {
    let reach = DraftReach { sink: 2, window: 8 };
    let mut s = CompactStore::with_reach(W, StoreFormat::F32, Some(reach), &Device::flex());
    append(&mut s, 0, 300);
    s.truncate(150);
    assert_eq!(s.len(), 150);
    let (pos, ..) = s.read_reach().unwrap();
    assert_eq!(pos, vec![0, 1]);
    append(&mut s, 150, 20);
    let (pos, ..) = s.read_reach().unwrap();
    assert_eq!(pos, [0, 1].into_iter().chain(162..170).collect::<Vec<_>>());
    // Back into the sink: the tail starts again after it.
    s.truncate(1);
    append(&mut s, 1, 12);
    let mut whole = CompactStore::new(W, None, &Device::flex());
    append(&mut whole, 0, 13);
    reads_as_whole(&s, &whole, reach);
}

#[test]
fn an_f16_store_reads_back_f16_values_in_half_the_bytes() {
    let (mut h, mut f) = (
        CompactStore::with_reach(W, StoreFormat::F16, None, &Device::flex()),
        CompactStore::new(W, None, &Device::flex()),
    );
    append(&mut h, 0, 100);
    append(&mut f, 0, 100);
    let (hk, _) = h.read(0..100).unwrap();
    let (fk, _) = f.read(0..100).unwrap();
    for (a, b) in host(hk).into_iter().zip(host(fk)) {
        assert_eq!(a, half::f16::from_f32(b).to_f32());
    }
    assert_eq!(h.nbytes() * 2, f.nbytes());
}
