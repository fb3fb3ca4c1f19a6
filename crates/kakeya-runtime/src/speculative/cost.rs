//! A forward's cost against its rows: a line `α + β·x` (`x` = rows − 1) fitted by decayed
//! least squares to measured seconds, so that one noisy timing of a rarely run length cannot
//! stick. The adaptive schedule prices verify blocks with it, and the server prices the rows
//! of its stacked forwards.

/// Weight of an old measurement after each new one.
const DECAY: f64 = 0.95;

/// Decayed least-squares line of seconds against extra rows.
#[derive(Debug, Clone, Default)]
pub struct CostLine {
    /// Decayed sums: weight, x, x², y, x·y.
    fit: [f64; 5],
    /// The slope assumed, relative to `α`, while only one `x` has been measured.
    prior_slope: f64,
}

impl CostLine {
    /// An empty line whose slope is `prior_slope · α` until two lengths are measured.
    pub fn new(prior_slope: f64) -> Self {
        Self {
            fit: [0.0; 5],
            prior_slope,
        }
    }

    /// Adds a forward of `x + 1` rows that took `secs`.
    pub fn add(&mut self, x: usize, secs: f64) {
        let x = x as f64;
        for (f, v) in self.fit.iter_mut().zip([1.0, x, x * x, secs, x * secs]) {
            *f = DECAY * *f + v;
        }
    }

    /// `(α, β)`: seconds of one row and of each further row; `None` before any measurement.
    /// With one length measured so far, the mean at the mean length and the prior's slope.
    pub fn coefficients(&self) -> Option<(f64, f64)> {
        let [s0, s1, s2, sy, sxy] = self.fit;
        if s0 <= 0.0 {
            return None;
        }
        let det = s0 * s2 - s1 * s1;
        Some(if det > 1e-9 * s0 * s0 {
            let beta = ((s0 * sxy - s1 * sy) / det).max(0.0);
            ((sy - beta * s1) / s0, beta)
        } else {
            let (xm, ym) = (s1 / s0, sy / s0);
            let alpha = ym / (1.0 + self.prior_slope * xm);
            (alpha, self.prior_slope * alpha)
        })
    }

    /// Estimated seconds of a forward of `x + 1` rows.
    pub fn at(&self, x: usize) -> Option<f64> {
        let (alpha, beta) = self.coefficients()?;
        Some((alpha + beta * x as f64).max(1e-9))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fits_a_line_and_uses_the_prior_with_one_length() {
        let mut c = CostLine::new(0.3);
        assert_eq!(c.at(0), None);
        c.add(0, 2.0);
        let (a, b) = c.coefficients().unwrap();
        assert!(
            (a - 2.0).abs() < 1e-12 && (b - 0.6).abs() < 1e-12,
            "{a} {b}"
        );
        for i in 0..100 {
            let x = [0, 3, 7, 1, 5][i % 5];
            c.add(x, 1.0 + 0.5 * x as f64);
        }
        // The first point (2.0 at x = 0) is off the line; it has decayed to nothing.
        let (a, b) = c.coefficients().unwrap();
        assert!((a - 1.0).abs() < 1e-2 && (b - 0.5).abs() < 1e-2, "{a} {b}");
        assert!((c.at(4).unwrap() - (a + 4.0 * b)).abs() < 1e-12);
    }
}
