//! Small statistics helpers: latency percentiles, medians of repeated runs, fairness.

use std::time::Duration;

use hdrhistogram::Histogram;

/// A latency histogram in nanoseconds, 1 ns to 100 s at 3 significant digits.
pub struct Latencies(Histogram<u64>);

impl Latencies {
    pub fn new() -> Self {
        // The bounds are constants that hdrhistogram accepts.
        Self(Histogram::new_with_bounds(1, 100_000_000_000, 3).expect("valid histogram bounds"))
    }

    pub fn record(&mut self, value: Duration) {
        let nanos = u64::try_from(value.as_nanos()).unwrap_or(u64::MAX).max(1);
        self.0.saturating_record(nanos);
    }

    pub fn merge(&mut self, other: &Latencies) {
        // Both histograms share the same bounds, so adding cannot fail.
        let _ = self.0.add(&other.0);
    }

    pub fn len(&self) -> u64 {
        self.0.len()
    }

    /// The value at `quantile` (0..=1), in microseconds.
    pub fn micros(&self, quantile: f64) -> f64 {
        self.0.value_at_quantile(quantile) as f64 / 1e3
    }

    pub fn max_micros(&self) -> f64 {
        self.0.max() as f64 / 1e3
    }
}

/// The median of repeated measurements (the machine is shared and noisy).
pub fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    match sorted.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => sorted[n / 2],
        n => (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0,
    }
}

/// The smallest and largest of repeated measurements, to print beside their median.
pub fn min_max(values: &[f64]) -> (f64, f64) {
    let min = values.iter().copied().fold(f64::NAN, f64::min);
    let max = values.iter().copied().fold(f64::NAN, f64::max);
    (min, max)
}

/// Jain's fairness index: 1.0 when every participant got the same share, 1/n when one got
/// everything.
pub fn jain(counts: &[u64]) -> f64 {
    let sum: f64 = counts.iter().map(|&c| c as f64).sum();
    let squares: f64 = counts.iter().map(|&c| (c as f64).powi(2)).sum();
    if squares == 0.0 {
        return f64::NAN;
    }
    sum * sum / (counts.len() as f64 * squares)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jain_bounds() {
        assert!((jain(&[5, 5, 5, 5]) - 1.0).abs() < 1e-9);
        assert!((jain(&[8, 0, 0, 0]) - 0.25).abs() < 1e-9);
    }

    #[test]
    fn min_max_of_values() {
        assert_eq!(min_max(&[3.0, 1.0, 2.0]), (1.0, 3.0));
        assert!(min_max(&[]).0.is_nan());
    }

    #[test]
    fn median_of_odd_and_even() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
    }
}
