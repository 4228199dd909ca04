//! Mutual-exclusion checking over recorded lock holds.
//!
//! Each time a test's worker believes it holds the lock it records an
//! [`Interval`] (start, end, fencing token, holder). After the run,
//! [`analyze`] checks the two safety properties a distributed lock must
//! provide: no two holds overlap in time, and fencing tokens strictly
//! increase from one hold to the next.
//!
//! Timestamps come from [`monotonic_ns`], which is
//! shared by all processes of a machine, so intervals recorded by several
//! processes can be written with [`ExclusionChecker::write_jsonl`], read
//! back with [`read_jsonl`], and analysed together.

use std::fmt;
use std::fs::File;
use std::io::{BufRead, BufReader, BufWriter, Write};
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};

use serde::{Deserialize, Serialize};

use crate::clock::monotonic_ns;
use crate::error::TestkitError;

/// How many offending pairs of each kind [`ExclusionReport`]'s `Display`
/// prints; the full lists stay available in the struct fields.
const DISPLAY_LIMIT: usize = 10;

/// One lock hold: the time span during which `holder` believed it owned the
/// lock, and the fencing token it was granted.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Interval {
    /// When the hold began, in [`monotonic_ns`] nanoseconds.
    pub start_ns: u64,
    /// When the hold ended (the holder stopped touching the protected
    /// resource), in [`monotonic_ns`] nanoseconds.
    pub end_ns: u64,
    /// Fencing token granted with the lock.
    pub token: u64,
    /// Free-form identity of the holder (process, task, ...), for reports.
    pub holder: String,
}

impl fmt::Display for Interval {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} token={} [{}..{}]",
            self.holder, self.token, self.start_ns, self.end_ns
        )
    }
}

/// Thread-safe collector of [`Interval`]s.
///
/// Cloning is cheap and every clone appends to the same list, so one checker
/// can be handed to many tasks or threads.
#[derive(Debug, Clone, Default)]
pub struct ExclusionChecker {
    intervals: Arc<Mutex<Vec<Interval>>>,
}

impl ExclusionChecker {
    /// Creates an empty checker.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds an already-complete interval.
    pub fn record(&self, interval: Interval) {
        self.lock().push(interval);
    }

    /// Starts a hold now; the returned [`HoldRecord`] records the interval
    /// when it is finished or dropped.
    ///
    /// Call this right *after* acquiring the lock and finish the record right
    /// *before* releasing it, so the recorded span is inside the real hold.
    #[must_use = "dropping the HoldRecord immediately records an empty hold"]
    pub fn enter(&self, token: u64, holder: impl Into<String>) -> HoldRecord {
        HoldRecord {
            checker: self.clone(),
            start_ns: monotonic_ns(),
            token,
            holder: holder.into(),
            finished: false,
        }
    }

    /// A snapshot of all intervals recorded so far, in recording order.
    pub fn intervals(&self) -> Vec<Interval> {
        self.lock().clone()
    }

    /// Adds many intervals, e.g. ones read from another process's file.
    pub fn extend(&self, intervals: impl IntoIterator<Item = Interval>) {
        self.lock().extend(intervals);
    }

    /// Writes every recorded interval to `path` as JSON Lines (one interval
    /// per line), replacing the file.
    pub fn write_jsonl(&self, path: impl AsRef<Path>) -> Result<(), TestkitError> {
        let path = path.as_ref();
        let context = || format!("writing intervals to `{}`", path.display());
        let file = File::create(path).map_err(TestkitError::io(context()))?;
        let mut out = BufWriter::new(file);
        for interval in self.intervals() {
            serde_json::to_writer(&mut out, &interval).map_err(TestkitError::JsonEncode)?;
            out.write_all(b"\n").map_err(TestkitError::io(context()))?;
        }
        out.flush().map_err(TestkitError::io(context()))
    }

    /// Reads intervals from a JSON Lines file; see [`read_jsonl`].
    pub fn read_jsonl(path: impl AsRef<Path>) -> Result<Vec<Interval>, TestkitError> {
        read_jsonl(path)
    }

    /// Analyses everything recorded so far; see [`analyze`].
    pub fn report(&self) -> ExclusionReport {
        analyze(&self.lock())
    }

    fn lock(&self) -> MutexGuard<'_, Vec<Interval>> {
        // A panic while holding this lock can only interrupt a push/extend,
        // which leaves the Vec valid, so a poisoned lock is safe to reuse
        // and keeps the checker usable for the report that explains the
        // failure.
        self.intervals
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// An in-progress hold started by [`ExclusionChecker::enter`].
///
/// The interval is recorded by [`finish`](HoldRecord::finish) or, if the
/// record is dropped unfinished (early return, panic unwinding), by `Drop`,
/// so that holds cut short still take part in the analysis.
#[derive(Debug)]
pub struct HoldRecord {
    checker: ExclusionChecker,
    start_ns: u64,
    token: u64,
    holder: String,
    finished: bool,
}

impl HoldRecord {
    /// Ends the hold now and records it.
    pub fn finish(mut self) {
        self.record_now();
    }

    fn record_now(&mut self) {
        if self.finished {
            return;
        }
        self.finished = true;
        self.checker.record(Interval {
            start_ns: self.start_ns,
            end_ns: monotonic_ns(),
            token: self.token,
            holder: std::mem::take(&mut self.holder),
        });
    }
}

impl Drop for HoldRecord {
    fn drop(&mut self) {
        self.record_now();
    }
}

/// Reads intervals written by [`ExclusionChecker::write_jsonl`]. Blank
/// lines are skipped.
pub fn read_jsonl(path: impl AsRef<Path>) -> Result<Vec<Interval>, TestkitError> {
    let path = path.as_ref();
    let context = || format!("reading intervals from `{}`", path.display());
    let file = File::open(path).map_err(TestkitError::io(context()))?;
    let mut intervals = Vec::new();
    for (index, line) in BufReader::new(file).lines().enumerate() {
        let line = line.map_err(TestkitError::io(context()))?;
        if line.trim().is_empty() {
            continue;
        }
        let interval = serde_json::from_str(&line).map_err(|source| TestkitError::JsonDecode {
            path: path.to_path_buf(),
            line: index + 1,
            source,
        })?;
        intervals.push(interval);
    }
    Ok(intervals)
}

/// Result of checking a set of holds for mutual exclusion.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExclusionReport {
    /// Number of holds analysed.
    pub holds: usize,
    /// Pairs of holds that overlapped in time: `(earlier, later)`, where
    /// `later` started before `earlier` ended.
    pub overlaps: Vec<(Interval, Interval)>,
    /// Consecutive holds (in start order) whose fencing token did not
    /// strictly increase: `(previous, offending)`.
    pub token_regressions: Vec<(Interval, Interval)>,
}

impl ExclusionReport {
    /// `true` when no overlaps and no token regressions were found.
    pub fn is_clean(&self) -> bool {
        self.overlaps.is_empty() && self.token_regressions.is_empty()
    }
}

impl fmt::Display for ExclusionReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_clean() {
            return write!(
                f,
                "{} holds: mutual exclusion held, tokens strictly increasing",
                self.holds
            );
        }
        write!(
            f,
            "{} holds: {} overlap(s), {} token regression(s)",
            self.holds,
            self.overlaps.len(),
            self.token_regressions.len()
        )?;
        let sections = [
            ("overlap", &self.overlaps),
            ("token regression", &self.token_regressions),
        ];
        for (label, pairs) in sections {
            for (first, second) in pairs.iter().take(DISPLAY_LIMIT) {
                write!(f, "\n  {label}: {first}  vs  {second}")?;
            }
            if pairs.len() > DISPLAY_LIMIT {
                write!(f, "\n  ... and {} more", pairs.len() - DISPLAY_LIMIT)?;
            }
        }
        Ok(())
    }
}

/// Checks holds for overlapping time spans and non-increasing fencing tokens.
///
/// Intervals are ordered by start time (ties by end time). A hold overlaps
/// the earlier hold that reaches furthest into the future if it starts
/// strictly before that hold ends; holds that merely touch (`start ==
/// previous end`) do not count. Every hold must carry a token strictly
/// greater than the hold before it, so reentrant or renewed holds should be
/// recorded once, not once per acquisition.
pub fn analyze(intervals: &[Interval]) -> ExclusionReport {
    let mut sorted: Vec<&Interval> = intervals.iter().collect();
    sorted.sort_by_key(|interval| (interval.start_ns, interval.end_ns));

    let mut report = ExclusionReport {
        holds: sorted.len(),
        ..ExclusionReport::default()
    };
    // The earlier interval with the greatest end: if the current interval
    // starts before it ends, they overlap, and no other earlier interval can
    // reveal an overlap this one would miss.
    let mut furthest: Option<&Interval> = None;
    let mut previous: Option<&Interval> = None;
    for &current in &sorted {
        if let Some(earlier) = furthest {
            if current.start_ns < earlier.end_ns {
                report.overlaps.push((earlier.clone(), current.clone()));
            }
        }
        if furthest.is_none_or(|earlier| current.end_ns > earlier.end_ns) {
            furthest = Some(current);
        }
        if let Some(prev) = previous {
            if current.token <= prev.token {
                report
                    .token_regressions
                    .push((prev.clone(), current.clone()));
            }
        }
        previous = Some(current);
    }
    report
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hold(start_ns: u64, end_ns: u64, token: u64, holder: &str) -> Interval {
        Interval {
            start_ns,
            end_ns,
            token,
            holder: holder.to_owned(),
        }
    }

    #[test]
    fn clean_sequence_is_clean() {
        // Deliberately unsorted, and touching at the boundaries.
        let holds = [
            hold(20, 30, 3, "c"),
            hold(0, 10, 1, "a"),
            hold(10, 20, 2, "b"),
        ];
        let report = analyze(&holds);
        assert_eq!(report.holds, 3);
        assert!(report.is_clean(), "{report}");
        assert!(report.to_string().contains("mutual exclusion held"));
    }

    #[test]
    fn empty_input_is_clean() {
        let report = analyze(&[]);
        assert_eq!(report.holds, 0);
        assert!(report.is_clean());
    }

    #[test]
    fn overlap_is_reported_with_both_holds() {
        let a = hold(0, 10, 1, "a");
        let b = hold(5, 15, 2, "b");
        let report = analyze(&[b.clone(), a.clone()]);
        assert_eq!(report.overlaps, vec![(a, b)]);
        assert!(report.token_regressions.is_empty());
        assert!(!report.is_clean());
        assert!(report.to_string().contains("1 overlap(s)"));
    }

    #[test]
    fn overlap_inside_a_long_hold_is_found_past_a_short_one() {
        // `c` starts after `b` ended but still inside `a`.
        let a = hold(0, 100, 1, "a");
        let b = hold(10, 20, 2, "b");
        let c = hold(30, 40, 3, "c");
        let report = analyze(&[a.clone(), b.clone(), c.clone()]);
        assert_eq!(report.overlaps, vec![(a.clone(), b), (a, c)]);
    }

    #[test]
    fn token_regression_is_reported() {
        let a = hold(0, 10, 5, "a");
        let b = hold(10, 20, 4, "b");
        let c = hold(20, 30, 6, "c");
        let report = analyze(&[a.clone(), b.clone(), c]);
        assert!(report.overlaps.is_empty());
        assert_eq!(report.token_regressions, vec![(a, b)]);
        assert!(!report.is_clean());
    }

    #[test]
    fn repeated_token_is_a_regression() {
        let a = hold(0, 10, 7, "a");
        let b = hold(10, 20, 7, "b");
        let report = analyze(&[a.clone(), b.clone()]);
        assert_eq!(report.token_regressions, vec![(a, b)]);
    }

    #[test]
    fn hold_record_records_on_finish_and_on_drop() {
        let checker = ExclusionChecker::new();
        checker.enter(1, "finished").finish();
        {
            let _dropped = checker.enter(2, "dropped");
        }
        let intervals = checker.intervals();
        assert_eq!(intervals.len(), 2);
        assert_eq!(intervals[0].holder, "finished");
        assert_eq!(intervals[1].holder, "dropped");
        assert!(intervals.iter().all(|i| i.start_ns <= i.end_ns));
        assert!(checker.report().is_clean(), "{}", checker.report());
    }

    #[test]
    fn jsonl_round_trip() -> Result<(), TestkitError> {
        let dir = tempfile::tempdir().map_err(TestkitError::io("creating temp dir"))?;
        let path = dir.path().join("holds.jsonl");
        let checker = ExclusionChecker::new();
        checker.extend([hold(0, 10, 1, "a"), hold(10, 20, 2, "b")]);
        checker.write_jsonl(&path)?;
        assert_eq!(ExclusionChecker::read_jsonl(&path)?, checker.intervals());
        Ok(())
    }

    #[test]
    fn jsonl_error_names_the_line() -> Result<(), TestkitError> {
        let dir = tempfile::tempdir().map_err(TestkitError::io("creating temp dir"))?;
        let path = dir.path().join("bad.jsonl");
        let good = r#"{"start_ns":0,"end_ns":1,"token":1,"holder":"a"}"#;
        std::fs::write(&path, format!("{good}\n\nnot json\n"))
            .map_err(TestkitError::io("writing fixture"))?;
        match read_jsonl(&path) {
            Err(TestkitError::JsonDecode { line, .. }) => assert_eq!(line, 3),
            other => panic!("expected JsonDecode on line 3, got {other:?}"),
        }
        Ok(())
    }
}
