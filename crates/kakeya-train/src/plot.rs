//! PNG charts drawn with a small built-in bitmap font (no font file needed): `curves.png` —
//! training loss per step (left) and a held-out metric per evaluation (right: the drafter's
//! simulated acceptance length, f_θ's attention-output error) — and [`chart`], several labelled
//! series in one panel (e.g. recall against KV bytes per mode).

use crate::train::{EvalRecord, StepRecord};

const W: usize = 960;
const H: usize = 400;
const PANEL_W: usize = W / 2;
const MARGIN: usize = 44;

/// 3×5 glyphs, one row per `u8` (3 low bits, leftmost = bit 2).
fn glyph(c: char) -> [u8; 5] {
    match c {
        '0' => [7, 5, 5, 5, 7],
        '1' => [2, 6, 2, 2, 7],
        '2' => [7, 1, 7, 4, 7],
        '3' => [7, 1, 7, 1, 7],
        '4' => [5, 5, 7, 1, 1],
        '5' => [7, 4, 7, 1, 7],
        '6' => [7, 4, 7, 5, 7],
        '7' => [7, 1, 1, 1, 1],
        '8' => [7, 5, 7, 5, 7],
        '9' => [7, 5, 7, 1, 7],
        '.' => [0, 0, 0, 0, 2],
        '-' => [0, 0, 7, 0, 0],
        ' ' => [0, 0, 0, 0, 0],
        'A' => [2, 5, 7, 5, 5],
        'B' => [6, 5, 6, 5, 6],
        'C' => [7, 4, 4, 4, 7],
        'D' => [6, 5, 5, 5, 6],
        'E' => [7, 4, 6, 4, 7],
        'F' => [7, 4, 6, 4, 4],
        'G' => [7, 4, 5, 5, 7],
        'H' => [5, 5, 7, 5, 5],
        'I' => [7, 2, 2, 2, 7],
        'J' => [1, 1, 1, 5, 7],
        'K' => [5, 5, 6, 5, 5],
        'L' => [4, 4, 4, 4, 7],
        'M' => [5, 7, 7, 5, 5],
        'N' => [6, 5, 5, 5, 5],
        'O' => [7, 5, 5, 5, 7],
        'P' => [7, 5, 7, 4, 4],
        'Q' => [7, 5, 5, 7, 1],
        'R' => [7, 5, 6, 5, 5],
        'S' => [7, 4, 7, 1, 7],
        'T' => [7, 2, 2, 2, 2],
        'U' => [5, 5, 5, 5, 7],
        'V' => [5, 5, 5, 5, 2],
        'W' => [5, 5, 7, 7, 5],
        'X' => [5, 5, 2, 5, 5],
        'Y' => [5, 5, 2, 2, 2],
        '/' => [1, 1, 2, 4, 4],
        'Z' => [7, 1, 2, 4, 7],
        '(' => [1, 2, 2, 2, 1],
        ')' => [4, 2, 2, 2, 4],
        ',' => [0, 0, 0, 2, 4],
        ':' => [0, 2, 0, 2, 0],
        _ => [7, 7, 7, 7, 7],
    }
}

struct Canvas {
    px: Vec<u8>,
}

impl Canvas {
    fn new() -> Self {
        Self {
            px: vec![255; W * H * 3],
        }
    }

    fn dot(&mut self, x: i64, y: i64, rgb: [u8; 3]) {
        if (0..W as i64).contains(&x) && (0..H as i64).contains(&y) {
            let i = (y as usize * W + x as usize) * 3;
            self.px[i..i + 3].copy_from_slice(&rgb);
        }
    }

    fn line(&mut self, (x0, y0): (f64, f64), (x1, y1): (f64, f64), rgb: [u8; 3]) {
        let n = ((x1 - x0).abs().max((y1 - y0).abs()).ceil() as usize).max(1);
        for i in 0..=n {
            let t = i as f64 / n as f64;
            let (x, y) = (x0 + (x1 - x0) * t, y0 + (y1 - y0) * t);
            self.dot(x.round() as i64, y.round() as i64, rgb);
            self.dot(x.round() as i64, y.round() as i64 + 1, rgb);
        }
    }

    fn text(&mut self, x: usize, y: usize, s: &str, scale: usize) {
        self.text_rgb(x, y, s, scale, [0, 0, 0]);
    }

    fn text_rgb(&mut self, x: usize, y: usize, s: &str, scale: usize, rgb: [u8; 3]) {
        for (i, c) in s.chars().enumerate() {
            let g = glyph(c.to_ascii_uppercase());
            for (r, bits) in g.iter().enumerate() {
                for col in 0..3 {
                    if bits & (4 >> col) != 0 {
                        for dy in 0..scale {
                            for dx in 0..scale {
                                self.dot(
                                    (x + (i * 4 + col) * scale + dx) as i64,
                                    (y + r * scale + dy) as i64,
                                    rgb,
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    /// One panel: axes, min/max labels, the series.
    fn panel(&mut self, x0: usize, title: &str, pts: &[(f64, f64)], rgb: [u8; 3]) {
        self.panel_series(
            (x0, PANEL_W),
            title,
            "STEP",
            &[Series {
                label: String::new(),
                rgb,
                points: pts.to_vec(),
            }],
            None,
        );
    }

    /// A panel `x0..x0 + width` with several series (labelled in a legend when named), axis
    /// ranges from the data or `y_range`.
    fn panel_series(
        &mut self,
        (x0, width): (usize, usize),
        title: &str,
        x_label: &str,
        series: &[Series],
        y_range: Option<(f64, f64)>,
    ) {
        let (left, right) = (x0 + MARGIN, x0 + width - 16);
        let (top, bottom) = (28, H - MARGIN);
        self.text(left, 8, title, 2);
        let black = [0, 0, 0];
        self.line(
            (left as f64, top as f64),
            (left as f64, bottom as f64),
            black,
        );
        self.line(
            (left as f64, bottom as f64),
            (right as f64, bottom as f64),
            black,
        );
        let pts: Vec<(f64, f64)> = series.iter().flat_map(|s| s.points.clone()).collect();
        if pts.is_empty() {
            return;
        }
        let (mut xmin, mut xmax) = (f64::MAX, f64::MIN);
        let (mut ymin, mut ymax) = (f64::MAX, f64::MIN);
        for &(x, y) in &pts {
            xmin = xmin.min(x);
            xmax = xmax.max(x);
            ymin = ymin.min(y);
            ymax = ymax.max(y);
        }
        if let Some((lo, hi)) = y_range {
            (ymin, ymax) = (lo, hi);
        }
        if xmax <= xmin {
            xmax = xmin + 1.0;
        }
        if ymax <= ymin {
            ymax = ymin + 1.0;
        }
        let sx = |x: f64| left as f64 + (x - xmin) / (xmax - xmin) * (right - left) as f64;
        let sy = |y: f64| bottom as f64 - (y - ymin) / (ymax - ymin) * (bottom - top) as f64;
        for (i, s) in series.iter().enumerate() {
            for w in s.points.windows(2) {
                self.line((sx(w[0].0), sy(w[0].1)), (sx(w[1].0), sy(w[1].1)), s.rgb);
            }
            for &(x, y) in &s.points {
                let (x, y) = (sx(x), sy(y));
                self.line((x - 2.0, y - 2.0), (x + 2.0, y - 2.0), s.rgb);
                self.line((x - 2.0, y + 1.0), (x + 2.0, y + 1.0), s.rgb);
            }
            if !s.label.is_empty() {
                self.text_rgb(right - 150, top + 4 + i * 12, &s.label, 2, s.rgb);
            }
        }
        self.text(x0 + 2, top, &format!("{ymax:.2}"), 1);
        self.text(x0 + 2, bottom - 5, &format!("{ymin:.2}"), 1);
        let num = |x: f64| {
            if x.fract() == 0.0 {
                format!("{x:.0}")
            } else {
                format!("{x:.2}")
            }
        };
        self.text(left, bottom + 6, &num(xmin), 1);
        let xl = num(xmax);
        self.text(right - xl.len() * 4, bottom + 6, &xl, 1);
        self.text(
            (left + right) / 2 - x_label.len() * 2,
            bottom + 18,
            x_label,
            1,
        );
    }

    fn png(&self) -> Vec<u8> {
        let mut out = Vec::new();
        {
            let mut enc = png::Encoder::new(&mut out, W as u32, H as u32);
            enc.set_color(png::ColorType::Rgb);
            enc.set_depth(png::BitDepth::Eight);
            let mut w = enc.write_header().expect("png header to memory");
            w.write_image_data(&self.px).expect("png data to memory");
        }
        out
    }
}

/// One labelled line of a [`chart`].
#[derive(Debug, Clone)]
pub struct Series {
    /// Legend text (empty: none).
    pub label: String,
    /// Colour.
    pub rgb: [u8; 3],
    /// Points, drawn joined in order.
    pub points: Vec<(f64, f64)>,
}

/// A PNG of one panel holding every series, `y_range` fixed when given.
pub fn chart(
    title: &str,
    x_label: &str,
    series: &[Series],
    y_range: Option<(f64, f64)>,
) -> Vec<u8> {
    let mut c = Canvas::new();
    c.panel_series((0, W), title, x_label, series, y_range);
    c.png()
}

/// The training loss per step, smoothed over a window of 1/50 of the steps.
pub fn smoothed_loss(steps: &[StepRecord]) -> Vec<(f64, f64)> {
    let win = (steps.len() / 50).max(1);
    steps
        .windows(win)
        .map(|w| {
            let mean = w.iter().map(|s| s.loss).sum::<f64>() / w.len() as f64;
            (w[w.len() - 1].step as f64, mean)
        })
        .collect()
}

/// A PNG of two panels side by side: `(title, points)` each, red on the left, blue on the
/// right.
pub fn two_panels(left: (&str, &[(f64, f64)]), right: (&str, &[(f64, f64)])) -> Vec<u8> {
    let mut c = Canvas::new();
    c.panel(0, left.0, left.1, [200, 40, 40]);
    c.panel(PANEL_W, right.0, right.1, [30, 90, 200]);
    c.png()
}

/// A PNG of the drafter's loss and held-out acceptance curves.
pub fn curves(steps: &[StepRecord], evals: &[EvalRecord], block: usize) -> Vec<u8> {
    let acc: Vec<(f64, f64)> = evals
        .iter()
        .map(|e| (e.step as f64, e.acceptance_length))
        .collect();
    two_panels(
        ("TRAIN LOSS", &smoothed_loss(steps)),
        (&format!("HELD-OUT ACCEPTANCE B{block}"), &acc),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn curves_are_a_png_of_the_declared_size() {
        let steps: Vec<StepRecord> = (1..=20)
            .map(|i| StepRecord {
                step: i,
                loss: 5.0 / i as f64,
                lr: 1e-3,
                grad_norm: 1.0,
                secs: 0.1,
            })
            .collect();
        let evals = vec![EvalRecord {
            step: 20,
            loss: 1.0,
            acceptance_length: 2.5,
            per_slot_acceptance: vec![0.5],
            anchors: 10,
        }];
        let png = curves(&steps, &evals, 8);
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
        let d = png::Decoder::new(std::io::Cursor::new(png));
        let r = d.read_info().unwrap();
        assert_eq!((r.info().width, r.info().height), (W as u32, H as u32));
    }
}
