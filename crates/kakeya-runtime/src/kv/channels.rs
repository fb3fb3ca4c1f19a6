//! Keys quantised per channel (KIVI's layout): for every block of [`CHANNEL_BLOCK`] positions
//! fixed by absolute position (block `b` holds positions `b·64..(b+1)·64`), each channel gets its
//! own affine scale and minimum over the block's positions. Outlier channels — a few key
//! channels carry values tens of times larger than the rest — then cost only their own
//! precision, where a per-token group would stretch its step over them.
//!
//! A block is quantised once its last position is written; positions of the block still being
//! filled are held in f16, as the exact tiers hold them (with the last complete block's, so
//! that a rollback into it rebuilds it from the same values). Because blocks are fixed by
//! position and quantised from the same f16 values, a position comes back the same bits
//! however its prompt was chunked.

use half::f16;
use kakeya_models::ModelError;

use kakeya_kernels::codes::{Affine, MixedCodes, dequantize_codes, dequantize_mixed};

use super::rows::{Bits, pack_codes, quantise_group, quantise_group_fitted};

/// Positions per per-channel block.
pub const CHANNEL_BLOCK: usize = 64;

/// Zero bytes after a mixed block's last row, so that every row holds the four-byte window of
/// each of its codes ([`dequantize_mixed`] reads eight codes at a time through them).
const MIXED_SLACK: usize = 3;

/// One complete block: positions `start..end`, each position's codes (one per channel, packed
/// row by row so that a position is read in one pass), `[scale, minimum]` per channel.
#[derive(Debug, Clone)]
struct Block {
    /// Unique among the blocks of this process (a block rebuilt after a rollback gets a new
    /// one): what a reader's cached row layout is keyed by.
    id: u64,
    start: usize,
    end: usize,
    codes: Vec<u8>,
    params: Vec<[f16; 2]>,
    /// With bits mixed per channel: each channel's bits, two channels a byte (low nibble
    /// first). A row then holds the channels grouped by bits (most first, each group in
    /// channel order), each group packed from a byte boundary.
    mixed: Option<Vec<u8>>,
}

/// Bits per channel for a block whose channels span `ranges` (maximum − minimum): `bits` on
/// average (`bits · w` in all), each from 0 (the channel held as one value) to 8. Bits go one
/// at a time to the channel whose error they cut the most — a channel's squared error at `b`
/// bits taken as `range² · 4^−b` (reverse water-filling) — ties to the lowest channel.
fn allot(ranges: &[f32], bits: u32) -> Vec<u8> {
    let mut out = vec![0u8; ranges.len()];
    if bits >= 8 {
        out.fill(8);
        return out;
    }
    // A channel's error now, at its bits: the next bit cuts it by three quarters.
    let mut err: Vec<f64> = ranges
        .iter()
        .map(|&r| f64::from(r) * f64::from(r))
        .collect();
    for _ in 0..bits as usize * ranges.len() {
        let mut best: Option<usize> = None;
        for (c, &e) in err.iter().enumerate() {
            if out[c] < 8 && best.is_none_or(|b| e > err[b]) {
                best = Some(c);
            }
        }
        let Some(c) = best else { break };
        out[c] += 1;
        err[c] /= 4.0;
    }
    out
}

/// A mixed block's row layout: channels in row order (most bits first, each group in channel
/// order) and the groups as `(bits, channels)`.
fn layout(bits: &[u8]) -> (Vec<usize>, Vec<(u32, usize)>) {
    let mut order = Vec::with_capacity(bits.len());
    let mut groups = Vec::new();
    for b in (0..=8u8).rev() {
        let before = order.len();
        order.extend((0..bits.len()).filter(|&c| bits[c] == b));
        if order.len() > before {
            groups.push((u32::from(b), order.len() - before));
        }
    }
    (order, groups)
}

/// Fills `map` with where each channel's code sits in a row of a mixed block (channels
/// grouped by bits, most first, each group in channel order and from a byte boundary) and its
/// `[scale, minimum]`; returns the row's bytes.
fn mixed_codes(bits: &[u8], params: &[[f16; 2]], map: &mut MixedCodes) -> usize {
    let mut count = [0usize; 9];
    for &b in bits {
        count[usize::from(b)] += 1;
    }
    // First bit of each width's group, and of the next code in it.
    let mut next = [0usize; 9];
    let mut at = 0;
    for b in (1..=8).rev() {
        next[b] = at;
        at += (count[b] * b).div_ceil(8) * 8;
    }
    map.reset(bits.len());
    for (c, &b) in bits.iter().enumerate() {
        let b = usize::from(b);
        let [scale, min] = params[c];
        map.set(c, (next[b], b as u32), scale.to_f32(), min.to_f32());
        next[b] += b;
    }
    at / 8
}

/// Two 4-bit counts a byte, low nibble first.
fn nibbles(bits: &[u8]) -> Vec<u8> {
    bits.chunks(2)
        .map(|p| p[0] | (p.get(1).copied().unwrap_or(0) << 4))
        .collect()
}

fn unnibble(packed: &[u8], width: usize) -> Vec<u8> {
    (0..width)
        .map(|c| (packed[c / 2] >> (4 * (c % 2))) & 15)
        .collect()
}

/// Rows `width` wide quantised per channel over blocks of positions.
#[derive(Debug, Clone)]
pub struct ChannelRows {
    bits: Bits,
    width: usize,
    /// Each channel's range fitted for least squared error (else min–max).
    fitted: bool,
    /// Bits mixed per channel within a block by range ([`allot`]), `bits` on average.
    mixed: bool,
    /// First position ever held.
    origin: usize,
    blocks: std::collections::VecDeque<Block>,
    /// Rows of positions `tail_from..len` in f16: the last complete block's and the block
    /// being filled.
    tail: Vec<f16>,
    tail_from: usize,
    /// End of the last complete block (= `origin` before the first).
    quantised_to: usize,
    len: usize,
}

impl ChannelRows {
    /// Empty rows of `width` values whose first position will be `origin`.
    pub fn new(bits: Bits, width: usize, origin: usize) -> Self {
        Self {
            bits,
            width,
            fitted: false,
            mixed: false,
            origin,
            blocks: Default::default(),
            tail: Vec::new(),
            tail_from: origin,
            quantised_to: origin,
            len: origin,
        }
    }

    /// The same rows with each channel's range per block fitted for least squared error
    /// (`quantise_group_fitted` in [`super::rows`]).
    pub fn fitted(self) -> Self {
        Self {
            fitted: true,
            ..self
        }
    }

    /// The same rows with bits mixed per channel within each block: `bits` on average, more
    /// to the channels of wider range ([`allot`]).
    pub fn mixed(self) -> Self {
        Self {
            mixed: true,
            ..self
        }
    }

    /// Next position to write.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True before the first position is written.
    pub fn is_empty(&self) -> bool {
        self.len == self.origin
    }

    /// End of the block holding `p` (exclusive).
    fn block_end(p: usize) -> usize {
        (p / CHANNEL_BLOCK + 1) * CHANNEL_BLOCK
    }

    /// Appends the rows of positions `len()..len() + n` (`values`: `n · width`); quantises
    /// every block they complete.
    pub fn push(&mut self, values: &[f32]) {
        self.tail.extend(values.iter().map(|&x| f16::from_f32(x)));
        self.len += values.len() / self.width;
        loop {
            let end = Self::block_end(self.quantised_to);
            if self.len < end {
                break;
            }
            let start = self.quantised_to;
            let rows = &self.tail[(start - self.tail_from) * self.width..];
            let block = self.quantise(start, end, rows);
            self.blocks.push_back(block);
            // Keep the rows from this block's start on (a rollback may reopen it).
            self.tail.drain(..(start - self.tail_from) * self.width);
            self.tail_from = start;
            self.quantised_to = end;
        }
        // A long chunk leaves a large allocation behind: give back what two blocks don't use.
        let keep = 2 * CHANNEL_BLOCK * self.width;
        if self.tail.capacity() > keep.max(self.tail.len()) {
            self.tail.shrink_to(keep.max(self.tail.len()));
        }
    }

    /// Quantises positions `start..end` (`rows` begins with `start`'s row).
    fn quantise(&self, start: usize, end: usize, rows: &[f16]) -> Block {
        let (n, w) = (end - start, self.width);
        let columns: Vec<Vec<f32>> = (0..w)
            .map(|c| (0..n).map(|r| rows[r * w + c].to_f32()).collect())
            .collect();
        let bits: Vec<u8> = if self.mixed {
            let ranges: Vec<f32> = columns
                .iter()
                .map(|col| {
                    let (lo, hi) = col
                        .iter()
                        .fold((f32::MAX, f32::MIN), |(a, b), &x| (a.min(x), b.max(x)));
                    hi - lo
                })
                .collect();
            allot(&ranges, self.bits.count())
        } else {
            vec![self.bits.count() as u8; w]
        };
        let mut codes = vec![0u8; n * w];
        let (mut col_codes, mut params) = (Vec::with_capacity(n), Vec::with_capacity(w));
        for (c, column) in columns.iter().enumerate() {
            let Some(b) = Bits::narrow(u32::from(bits[c])) else {
                // No bits: the channel is held as its mean over the block.
                let mean = column.iter().sum::<f32>() / n as f32;
                params.push([f16::ZERO, f16::from_f32(mean)]);
                col_codes.clear();
                col_codes.resize(n, 0);
                for (r, &q) in col_codes.iter().enumerate() {
                    codes[r * w + c] = q;
                }
                continue;
            };
            params.push(if self.fitted {
                quantise_group_fitted(column, b, &mut col_codes)
            } else {
                quantise_group(column, b, &mut col_codes)
            });
            for (r, &q) in col_codes.iter().enumerate() {
                codes[r * w + c] = q;
            }
        }
        let mut packed = Vec::new();
        if self.mixed {
            let (order, groups) = layout(&bits);
            let mut seg = Vec::with_capacity(w);
            for row in codes.chunks_exact(w) {
                let mut at = 0;
                for &(b, count) in &groups {
                    if let Some(b) = Bits::narrow(b) {
                        seg.clear();
                        seg.extend(order[at..at + count].iter().map(|&c| row[c]));
                        pack_codes(&seg, b, &mut packed);
                    }
                    at += count;
                }
            }
        } else {
            for row in codes.chunks_exact(w) {
                pack_codes(row, self.bits, &mut packed);
            }
        }
        if self.mixed {
            // Rows are read four bytes at a time from each code's first byte: the last row's
            // windows reach three bytes past it.
            packed.extend([0u8; MIXED_SLACK]);
        }
        packed.shrink_to_fit();
        static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        Block {
            id: NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            start,
            end,
            codes: packed,
            params,
            mixed: self.mixed.then(|| nibbles(&bits)),
        }
    }

    /// Packed bytes of one position's codes.
    fn row_bytes(&self) -> usize {
        (self.width * self.bits.count() as usize).div_ceil(8)
    }

    /// Forgets positions `>= len`: a complete block that ends past `len` is reopened from its
    /// f16 rows; refused when those rows are gone (a rollback past the last complete block).
    pub fn truncate(&mut self, len: usize) -> kakeya_models::Result<()> {
        if len >= self.quantised_to {
            self.tail
                .truncate((len.min(self.len) - self.tail_from) * self.width);
            self.len = len.min(self.len);
            return Ok(());
        }
        let last_start = self.blocks.back().map_or(self.origin, |b| b.start);
        if len < last_start || len < self.tail_from {
            return Err(ModelError::Cache(format!(
                "cannot roll back to {len}: positions up to {} are already quantised per channel",
                self.quantised_to
            )));
        }
        self.blocks.pop_back();
        self.quantised_to = last_start;
        self.tail.truncate((len - self.tail_from) * self.width);
        self.len = len;
        Ok(())
    }

    /// Forgets whole blocks before position `pos` (never read again).
    pub fn drop_before(&mut self, pos: usize) {
        while self.blocks.front().is_some_and(|b| b.end <= pos) {
            self.blocks.pop_front();
        }
    }

    /// Dequantised rows of positions `from..to` (row-major, `width` each); every position must
    /// be in a complete block.
    pub fn read(&self, from: usize, to: usize) -> kakeya_models::Result<Vec<f32>> {
        let mut out = vec![0.0f32; to.saturating_sub(from) * self.width];
        self.read_into(from, to, &mut out)?;
        Ok(out)
    }

    /// [`Self::read`] into `out` (`(to − from) · width` long).
    pub fn read_into(&self, from: usize, to: usize, out: &mut [f32]) -> kakeya_models::Result<()> {
        let first = self.blocks.front().map_or(self.quantised_to, |b| b.start);
        if from < first || to > self.quantised_to {
            return Err(ModelError::Cache(format!(
                "per-channel keys hold positions {first}..{}, asked for {from}..{to}",
                self.quantised_to
            )));
        }
        let w = self.width;
        let first_block = first / CHANNEL_BLOCK;
        let mut p = from;
        while p < to {
            let b = &self.blocks[p / CHANNEL_BLOCK - first_block];
            let upto = to.min(b.end);
            let rows = &mut out[(p - from) * w..(upto - from) * w];
            match &b.mixed {
                None => self.read_uniform(b, p - b.start..upto - b.start, rows),
                Some(bits) => self.read_mixed(b, bits, p - b.start..upto - b.start, rows),
            }
            p = upto;
        }
        Ok(())
    }

    /// Rows `rows` of block `b` (codes of `self.bits` each) into `out`.
    fn read_uniform(&self, b: &Block, rows: std::ops::Range<usize>, out: &mut [f32]) {
        let (w, rb) = (self.width, self.row_bytes());
        let scale: Vec<f32> = b.params.iter().map(|p| p[0].to_f32()).collect();
        let min: Vec<f32> = b.params.iter().map(|p| p[1].to_f32()).collect();
        for (r, o) in rows.zip(out.chunks_exact_mut(w)) {
            let affine = Affine::PerCode {
                scale: &scale,
                min: &min,
            };
            dequantize_codes(&b.codes[r * rb..(r + 1) * rb], self.bits.count(), affine, o);
        }
    }

    /// Rows `rows` of a mixed block (its channels' bits in `nibbles`) into `out`, in channel order:
    /// where each channel's code sits in a row is worked out once for the block, then each
    /// row is read eight channels at a time (the bits of dequantising each width group and
    /// putting its values in place).
    fn read_mixed(&self, b: &Block, nibbles: &[u8], rows: std::ops::Range<usize>, out: &mut [f32]) {
        let w = self.width;
        // A tile of keys often ends inside a block and the next tile starts there: the
        // thread keeps the last block's map (blocks never change; a rebuilt one is new).
        thread_local! {
            static LAST: std::cell::RefCell<(u64, usize, MixedCodes)> =
                std::cell::RefCell::new((u64::MAX, 0, MixedCodes::new()));
        }
        LAST.with_borrow_mut(|(id, rb, map)| {
            if *id != b.id {
                *rb = mixed_codes(&unnibble(nibbles, w), &b.params, map);
                *id = b.id;
            }
            for (r, o) in rows.zip(out.chunks_exact_mut(w)) {
                dequantize_mixed(&b.codes[r * *rb..], map, o);
            }
        });
    }

    /// Bits of channel `c` at position `p` (mixed blocks: as allotted).
    pub fn bits_at(&self, p: usize, c: usize) -> Option<u32> {
        let first = self.blocks.front()?.start / CHANNEL_BLOCK;
        let b = self.blocks.get((p / CHANNEL_BLOCK).checked_sub(first)?)?;
        Some(match &b.mixed {
            Some(bits) => u32::from(unnibble(bits, self.width)[c]),
            None => self.bits.count(),
        })
    }

    /// Step (scale) of channel `c` at position `p` (error bounds in tests).
    pub fn scale(&self, p: usize, c: usize) -> Option<f32> {
        let first = self.blocks.front()?.start / CHANNEL_BLOCK;
        let b = self.blocks.get((p / CHANNEL_BLOCK).checked_sub(first)?)?;
        Some(b.params[c][0].to_f32())
    }

    /// Bytes allocated: codes, parameters and the f16 tail.
    pub fn nbytes(&self) -> usize {
        self.blocks
            .iter()
            .map(|b| {
                b.codes.capacity()
                    + b.params.capacity() * 4
                    + b.mixed.as_ref().map_or(0, Vec::capacity)
                    + std::mem::size_of::<Block>()
            })
            .sum::<usize>()
            + self.tail.capacity() * 2
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize, width: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
        (0..n * width)
            .map(|i| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let u = (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                // Channel 3 is an outlier channel, as real keys have.
                if i % width == 3 { 40.0 + u } else { u }
            })
            .collect()
    }

    #[test]
    fn values_come_back_within_half_a_channel_step_and_chunking_does_not_matter() {
        let width = 16;
        let x = values(300, width, 5);
        for bits in (2..=8).map(|b| Bits::new(b).unwrap()) {
            // From position 4 (after the sinks), in one chunk and in chunks of 1..=37.
            let mut whole = ChannelRows::new(bits, width, 4);
            whole.push(&x[..(300 - 4) * width]);
            let mut parts = ChannelRows::new(bits, width, 4);
            let (mut at, mut step) = (4, 1);
            while at < 300 {
                let n = step.min(300 - at);
                parts.push(&x[(at - 4) * width..(at - 4 + n) * width]);
                at += n;
                step = step % 37 + 1;
            }
            // Complete blocks end at 256: positions 4..256 are quantised.
            let a = whole.read(4, 256).unwrap();
            assert_eq!(a, parts.read(4, 256).unwrap(), "{bits:?}: chunking");
            for (i, (got, want)) in a.iter().zip(&x).enumerate() {
                // Blocks are quantised from the f16 values the tail holds.
                let want = f16::from_f32(*want).to_f32();
                let (p, c) = (4 + i / width, i % width);
                let s = whole.scale(p, c).unwrap();
                assert!(
                    (got - want).abs() <= s / 2.0 * (1.0 + 1e-3) + 1e-6,
                    "{bits:?}: position {p} channel {c}: {want} came back {got} (step {s})"
                );
                // The outlier channel does not widen the others' steps (their range is < 1).
                if c != 3 {
                    let top = ((1u32 << bits.count()) - 1) as f32;
                    assert!(s <= 1.01 / top, "{bits:?}: channel {c} step {s}");
                }
            }
            assert!(
                whole.read(4, 257).is_err(),
                "an incomplete block is not read"
            );
        }
    }

    #[test]
    fn fitted_channels_err_less_and_chunking_does_not_matter() {
        let width = 16;
        let x = values(300, width, 7);
        for bits in (2..=8).map(|b| Bits::new(b).unwrap()) {
            let mut plain = ChannelRows::new(bits, width, 0);
            plain.push(&x);
            let mut whole = ChannelRows::new(bits, width, 0).fitted();
            whole.push(&x);
            let mut parts = ChannelRows::new(bits, width, 0).fitted();
            for chunk in x.chunks(width * 23) {
                parts.push(chunk);
            }
            let (a, b) = (plain.read(0, 256).unwrap(), whole.read(0, 256).unwrap());
            assert_eq!(b, parts.read(0, 256).unwrap(), "{bits:?}: chunking");
            // Per block and channel, the fitted range errs no more than min–max.
            for block in 0..4 {
                for c in 0..width {
                    let err = |y: &[f32]| -> f64 {
                        (block * 64..(block + 1) * 64)
                            .map(|p| {
                                let want = f16::from_f32(x[p * width + c]).to_f32();
                                f64::from(y[p * width + c] - want).powi(2)
                            })
                            .sum()
                    };
                    assert!(
                        err(&b) <= err(&a) * (1.0 + 1e-4) + 1e-9,
                        "{bits:?}: block {block} channel {c}"
                    );
                }
            }
        }
    }

    /// Rows of a mixed block read group by group, each width's codes dequantised in row
    /// order and then put in channel order: the reference for [`ChannelRows::read_mixed`].
    fn read_mixed_by_groups(b: &Block, bits: &[u8], rows: std::ops::Range<usize>) -> Vec<f32> {
        let w = bits.len();
        let (order, groups) = layout(bits);
        let scale: Vec<f32> = order.iter().map(|&c| b.params[c][0].to_f32()).collect();
        let min: Vec<f32> = order.iter().map(|&c| b.params[c][1].to_f32()).collect();
        let rb: usize = groups
            .iter()
            .map(|&(bb, n)| (n * bb as usize).div_ceil(8))
            .sum();
        let mut out = vec![0.0f32; rows.len() * w];
        let mut tmp = vec![0.0f32; w];
        for (r, o) in rows.zip(out.chunks_exact_mut(w)) {
            let codes = &b.codes[r * rb..(r + 1) * rb];
            let (mut at, mut byte) = (0, 0);
            for &(bb, n) in &groups {
                let len = (n * bb as usize).div_ceil(8);
                if bb == 0 {
                    tmp[at..at + n].copy_from_slice(&min[at..at + n]);
                } else {
                    let affine = Affine::PerCode {
                        scale: &scale[at..at + n],
                        min: &min[at..at + n],
                    };
                    dequantize_codes(&codes[byte..byte + len], bb, affine, &mut tmp[at..at + n]);
                }
                at += n;
                byte += len;
            }
            for (&c, &x) in order.iter().zip(&tmp) {
                o[c] = x;
            }
        }
        out
    }

    #[test]
    fn mixed_bits_keep_the_average_favour_wide_channels_and_err_less() {
        let ranges: Vec<f32> = (0..16).map(|c| if c == 3 { 40.0 } else { 1.0 }).collect();
        for bits in 2..=8 {
            let a = allot(&ranges, bits);
            assert_eq!(a.iter().map(|&b| u32::from(b)).sum::<u32>(), bits * 16);
            assert!(a.iter().all(|&b| b <= 8), "{a:?}");
            assert!(a.iter().all(|&b| b <= a[3]), "{bits}: {a:?}");
        }
        // log2(40) ≈ 5.3 bits more than the others': the outlier gets 8, the other 15
        // channels share the 40 bits left (2 or 3 each, the first ones 3).
        let a = allot(&ranges, 3);
        assert_eq!(a[3], 8, "the outlier channel gets the most bits");
        assert!(
            a.iter()
                .enumerate()
                .all(|(c, &b)| c == 3 || (2..=3).contains(&b)),
            "{a:?}"
        );
        assert!(a[0] >= a[15], "ties go to the lowest channel: {a:?}");
        let width = 16;
        // Channel 3 spans 40 times the others' range (not only an offset, as in `values`).
        let x: Vec<f32> = values(300, width, 11)
            .iter()
            .enumerate()
            .map(|(i, &v)| if i % width == 3 { (v - 40.0) * 40.0 } else { v })
            .collect();
        for bits in (2..=8).map(|b| Bits::new(b).unwrap()) {
            let mut uniform = ChannelRows::new(bits, width, 4);
            uniform.push(&x[..296 * width]);
            let mut whole = ChannelRows::new(bits, width, 4).mixed();
            whole.push(&x[..296 * width]);
            let mut parts = ChannelRows::new(bits, width, 4).mixed();
            for chunk in x[..296 * width].chunks(width * 29) {
                parts.push(chunk);
            }
            let a = whole.read(4, 256).unwrap();
            assert_eq!(a, parts.read(4, 256).unwrap(), "{bits:?}: chunking");
            // Each block bit for bit as read group by group (every row, and rows from the
            // middle of a block to its end).
            for (k, b) in whole.blocks.iter().enumerate() {
                let nib = unnibble(b.mixed.as_ref().unwrap(), width);
                let from = if k % 2 == 0 { 0 } else { 17 };
                let rows = from..b.end - b.start;
                let want = read_mixed_by_groups(b, &nib, rows.clone());
                let got = whole.read(b.start + from, b.end).unwrap();
                let bits_of = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits_of(&got), bits_of(&want), "{bits:?}: block {k}");
            }
            let (mut err_mixed, mut err_uniform) = (0.0f64, 0.0f64);
            let u = uniform.read(4, 256).unwrap();
            for (i, ((got, flat), want)) in a.iter().zip(&u).zip(&x).enumerate() {
                let want = f16::from_f32(*want).to_f32();
                let (p, c) = (4 + i / width, i % width);
                let s = whole.scale(p, c).unwrap();
                let b = whole.bits_at(p, c).unwrap();
                // A channel of no bits comes back as its mean (the narrow channels span
                // under 1).
                let bound = if b == 0 {
                    1.0
                } else {
                    s / 2.0 * (1.0 + 1e-3) + 1e-6
                };
                assert!(
                    (got - want).abs() <= bound,
                    "{bits:?}: position {p} channel {c} ({b} bits): {want} came back {got} (step {s})"
                );
                assert!(b <= 8);
                err_mixed += f64::from(got - want).powi(2);
                err_uniform += f64::from(flat - want).powi(2);
            }
            // At 8 bits on average every channel has 8 (the most).
            if bits.count() < 8 {
                assert!(
                    err_mixed < 0.5 * err_uniform,
                    "{bits:?}: mixed {err_mixed} against uniform {err_uniform}"
                );
            }
        }
    }

    #[test]
    fn a_rollback_into_the_last_block_rebuilds_it_from_the_same_values() {
        let width = 8;
        let x = values(200, width, 9);
        let bits = Bits::new(3).unwrap();
        let mut r = ChannelRows::new(bits, width, 0);
        r.push(&x[..130 * width]); // blocks 0..64, 64..128 complete
        r.truncate(120).unwrap(); // reopens 64..128
        assert!(r.read(64, 65).is_err());
        r.push(&x[120 * width..200 * width]);
        let mut straight = ChannelRows::new(bits, width, 0);
        straight.push(&x[..200 * width]);
        assert_eq!(r.read(0, 192).unwrap(), straight.read(0, 192).unwrap());
        // Two blocks back is refused: those rows are gone.
        assert!(r.truncate(60).is_err());
        r.drop_before(128);
        assert!(r.read(0, 1).is_err());
        assert_eq!(r.read(128, 192).unwrap(), straight.read(128, 192).unwrap());
    }
}
