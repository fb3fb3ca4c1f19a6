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
#[path = "channels_tests.rs"]
mod tests;
