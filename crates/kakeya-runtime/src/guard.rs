//! The runaway-loop guard: stops generation whose tail is one short unit repeated over and
//! over ("the the the ...", "ha! ha! ha! ...") and trims it to a few copies.
//!
//! The rule is deliberately conservative: a unit of 1–8 tokens must repeat back to back at
//! least 12 times. Lists, enumerations and code change some token within every 8 (numbers,
//! names, operands), so they do not trip it.

/// When the guard fires and what it keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunawayGuard {
    /// Longest repeating unit considered, in tokens.
    pub max_unit: usize,
    /// Back-to-back copies of the unit that count as a runaway loop.
    pub min_repeats: usize,
    /// Copies of the unit left in the output when it fires.
    pub keep: usize,
}

impl Default for RunawayGuard {
    fn default() -> Self {
        Self {
            max_unit: 8,
            min_repeats: 12,
            keep: 3,
        }
    }
}

/// Length of the longest suffix of `tokens` with period `unit` (each token equals the one
/// `unit` before it), scanning at most `limit` tokens.
fn periodic_suffix(tokens: &[u32], unit: usize, limit: usize) -> usize {
    let n = tokens.len();
    if n < unit {
        return n;
    }
    let mut len = unit;
    while len < n.min(limit) && tokens[n - 1 - len] == tokens[n - 1 - len + unit] {
        len += 1;
    }
    len
}

impl RunawayGuard {
    /// If the tail of `tokens` is a runaway loop, the length to truncate to (keeping `keep`
    /// copies of the shortest repeating unit); `None` otherwise.
    pub fn check(&self, tokens: &[u32]) -> Option<usize> {
        (1..=self.max_unit).find_map(|unit| {
            let run = periodic_suffix(tokens, unit, unit * self.min_repeats);
            let copies = run / unit;
            (copies >= self.min_repeats).then(|| tokens.len() - (copies - self.keep) * unit)
        })
    }

    /// How many of the newest tokens a streaming caller should hold back: the part of a
    /// repeating tail that a later [`Self::check`] could still cut.
    pub fn holdback(&self, tokens: &[u32]) -> usize {
        (1..=self.max_unit)
            .map(|unit| {
                let run = periodic_suffix(tokens, unit, unit * self.min_repeats);
                run.saturating_sub((self.keep - 1) * unit)
            })
            .max()
            .unwrap_or(0)
            .min(tokens.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn repeat(unit: &[u32], times: usize) -> Vec<u32> {
        unit.iter()
            .copied()
            .cycle()
            .take(unit.len() * times)
            .collect()
    }

    #[test]
    fn fires_on_twelve_copies_and_keeps_three() {
        let g = RunawayGuard::default();
        for unit in [vec![5], vec![1, 2], vec![9, 8, 7, 6, 5, 4, 3, 2]] {
            let mut toks = vec![100, 101, 102];
            toks.extend(repeat(&unit, 11));
            assert_eq!(g.check(&toks), None, "11 copies of {unit:?} are allowed");
            toks.extend(&unit);
            let keep = g.check(&toks).expect("12 copies fire");
            assert_eq!(keep, 3 + 3 * unit.len());
            assert_eq!(&toks[3..keep], &repeat(&unit, 3)[..]);
        }
    }

    #[test]
    fn a_nine_token_unit_is_not_a_runaway() {
        let g = RunawayGuard::default();
        let toks = repeat(&[1, 2, 3, 4, 5, 6, 7, 8, 9], 20);
        assert_eq!(g.check(&toks), None);
    }

    #[test]
    fn shortest_unit_wins() {
        // "a a a ..." is also "a a" repeated: keep three single copies, not three pairs.
        let g = RunawayGuard::default();
        let toks = repeat(&[7], 12);
        assert_eq!(g.check(&toks), Some(3));
    }

    #[test]
    fn enumerations_lists_and_code_do_not_fire() {
        let g = RunawayGuard::default();
        // "1. item\n2. item\n..." with single-digit tokens, as Gemma's tokenizer splits numbers.
        let mut enumeration = Vec::new();
        for i in 1..=40u32 {
            for d in i.to_string().bytes() {
                enumeration.push(u32::from(d));
            }
            enumeration.extend([46, 500, 10]);
        }
        // "- apple\n- pear\n..." bullet list of varied items.
        let mut list = Vec::new();
        for i in 0..30u32 {
            list.extend([45, 600 + i % 17, 10]);
        }
        // Code: a matrix literal and nested blocks closing.
        let mut code = Vec::new();
        for r in 0..10u32 {
            code.push(91);
            for c in 0..6u32 {
                code.extend([700 + (r * 7 + c * 3) % 10, 44]);
            }
            code.extend([93, 44, 10]);
        }
        code.extend(repeat(&[125, 10], 6));
        for toks in [&enumeration, &list, &code] {
            for end in 1..=toks.len() {
                assert_eq!(g.check(&toks[..end]), None, "fired at {end}");
            }
        }
    }

    #[test]
    fn holdback_covers_everything_a_later_check_cuts() {
        let g = RunawayGuard::default();
        let mut toks: Vec<u32> = (200..210).collect();
        let unit = [1, 2, 3];
        let mut released = 0;
        for t in unit.iter().cycle().take(60) {
            toks.push(*t);
            if let Some(keep) = g.check(&toks) {
                assert!(released <= keep, "released {released} past the cut {keep}");
                return;
            }
            released = released.max(toks.len() - g.holdback(&toks));
        }
        panic!("the guard never fired");
    }

    #[test]
    fn holdback_releases_when_the_pattern_breaks() {
        let g = RunawayGuard::default();
        let mut toks = repeat(&[4, 5], 6);
        assert!(g.holdback(&toks) > 0);
        toks.extend([6, 7, 8, 9, 10, 11, 12, 13, 14]);
        assert_eq!(g.holdback(&toks), 0);
    }
}
