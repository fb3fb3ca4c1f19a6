//! The bookkeeping of recorded forwards ([`Recordings`]), one for every model that records
//! ([`super::DeviceGraph`]): the verifier's forwards and the drafter's blocks. A key is
//! recorded the second time it is seen (a recording costs four runs of the forward: a one-off
//! shape is not worth it), at most [`RECORDINGS_MAX`] recordings are kept (the least recently
//! used goes first), and one unused for [`IDLE_MAX`] eligible forwards is dropped (its
//! sequences have most likely finished, and a recording keeps every buffer it touched
//! reserved).

use std::sync::{Mutex, MutexGuard};

/// Most recordings kept.
pub const RECORDINGS_MAX: usize = 16;
/// Eligible forwards after which an unused recording is dropped.
pub const IDLE_MAX: u64 = 64;
/// Most keys remembered as seen once.
const SEEN_MAX: usize = 32;

/// How a model's forwards ran on a GPU.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct ReplayStats {
    /// Forwards recorded (each also ran).
    pub recorded: usize,
    /// Forwards replayed from a recording.
    pub replayed: usize,
    /// Forwards issued launch by launch though they could be recorded: first sightings,
    /// caches that are not plain buffers.
    pub declined: usize,
}

/// Recordings `R` by key `K`, with the keys seen once and the counts of [`ReplayStats`].
#[derive(Debug)]
pub struct Recordings<K, R> {
    /// Each recording, its key and the eligible forward that last used it.
    recorded: Vec<(K, u64, R)>,
    seen: Vec<K>,
    /// The device recorded nothing: issue from now on.
    pub off: bool,
    /// Eligible forwards so far.
    clock: u64,
    /// What ran how.
    pub stats: ReplayStats,
}

impl<K, R> Default for Recordings<K, R> {
    fn default() -> Self {
        Self {
            recorded: Vec::new(),
            seen: Vec::new(),
            off: false,
            clock: 0,
            stats: ReplayStats::default(),
        }
    }
}

impl<K: PartialEq, R> Recordings<K, R> {
    /// Starts an eligible forward: `false` where the device records nothing ([`Self::off`]:
    /// issue it), else counts it ([`Self::tick`]).
    pub fn begin(&mut self) -> bool {
        if self.off {
            return false;
        }
        self.tick();
        true
    }

    /// The device ran a forward it was asked to record instead of recording it: its outputs
    /// are real, it counts as declined, and every later forward is issued.
    pub fn records_nothing(&mut self) {
        self.off = true;
        self.stats.declined += 1;
    }

    /// Counts an eligible forward and drops the recordings unused for `IDLE_MAX` of them.
    pub fn tick(&mut self) {
        self.clock += 1;
        let now = self.clock;
        self.recorded.retain(|(_, used, _)| now - used <= IDLE_MAX);
    }

    /// The recording of `key`, marked as used now.
    pub fn find(&mut self, key: &K) -> Option<&mut R> {
        let now = self.clock;
        self.recorded
            .iter_mut()
            .find(|(k, _, _)| k == key)
            .map(|(_, used, r)| {
                *used = now;
                r
            })
    }

    /// Whether `key` was seen once before: then it is forgotten as seen and the caller records
    /// it now. Otherwise it is remembered (the oldest seen key forgotten beyond a bound) and
    /// the forward counts as declined.
    pub fn second_sighting(&mut self, key: K) -> bool {
        if self.seen.contains(&key) {
            self.seen.retain(|k| *k != key);
            return true;
        }
        if self.seen.len() >= SEEN_MAX {
            self.seen.remove(0);
        }
        self.seen.push(key);
        self.stats.declined += 1;
        false
    }

    /// Keeps a new recording (counted), dropping the least recently used one beyond
    /// `RECORDINGS_MAX`.
    pub fn insert(&mut self, key: K, recording: R) {
        if self.recorded.len() >= RECORDINGS_MAX
            && let Some(oldest) = (0..self.recorded.len()).min_by_key(|&i| self.recorded[i].1)
        {
            self.recorded.remove(oldest);
        }
        self.stats.recorded += 1;
        self.recorded.push((key, self.clock, recording));
    }

    /// Recordings held.
    pub fn len(&self) -> usize {
        self.recorded.len()
    }

    /// True when none is held.
    pub fn is_empty(&self) -> bool {
        self.recorded.is_empty()
    }
}

/// A model's [`Recordings`] behind a lock (forwards take `&self`). A clone of the model
/// starts with none: a recording holds its model's buffers.
pub struct Recorder<K, R>(Mutex<Recordings<K, R>>);

impl<K, R> Default for Recorder<K, R> {
    fn default() -> Self {
        Self(Mutex::new(Recordings::default()))
    }
}

impl<K, R> Clone for Recorder<K, R> {
    fn clone(&self) -> Self {
        Self::default()
    }
}

impl<K, R> std::fmt::Debug for Recorder<K, R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.lock();
        f.debug_struct("Recorder")
            .field("recordings", &s.recorded.len())
            .field("off", &s.off)
            .field("stats", &s.stats)
            .finish()
    }
}

impl<K, R> Recorder<K, R> {
    /// The recordings (a panic elsewhere under the lock leaves them usable).
    pub fn lock(&self) -> MutexGuard<'_, Recordings<K, R>> {
        self.0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::{IDLE_MAX, RECORDINGS_MAX, Recordings};

    #[test]
    fn a_key_records_at_its_second_sighting_and_the_least_recently_used_goes_first() {
        let mut r: Recordings<usize, &str> = Recordings::default();
        r.tick();
        assert!(!r.second_sighting(1), "first sighting");
        assert!(r.second_sighting(1), "second sighting");
        assert!(!r.second_sighting(1), "forgotten once recorded");
        assert_eq!(r.stats.declined, 2);
        for k in 0..RECORDINGS_MAX {
            r.tick();
            r.insert(k, "x");
        }
        r.tick();
        assert!(r.find(&0).is_some(), "key 0 used now");
        r.insert(99, "y");
        assert_eq!(r.len(), RECORDINGS_MAX);
        assert!(r.find(&0).is_some(), "the recently used one stays");
        assert!(r.find(&1).is_none(), "the least recently used went");
        assert_eq!(r.stats.recorded, RECORDINGS_MAX + 1);
        for _ in 0..=IDLE_MAX {
            r.tick();
        }
        assert!(r.is_empty(), "idle recordings dropped");
        assert!(r.begin(), "a recording device");
        r.records_nothing();
        assert!(!r.begin(), "then nothing is recorded");
        assert_eq!(r.stats.declined, 3);
    }
}
