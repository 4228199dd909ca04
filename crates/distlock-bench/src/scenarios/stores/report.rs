//! The stores scenario's reports: one per subject and row, for the table and `--json`,
//! and the side-by-side summary in Markdown (printed to stderr, so that stdout stays the
//! table or the JSON lines).

use super::deploy::{
    Deployed, POOLED, RAW_PLACEMENT, RAW_SCRIPTS, RAW_STATEMENTS, RAW_TXNS, UNPINGED, ZK_CYCLE,
    ZK_GET, ZK_PAIR,
};
use super::subject::{Subject, WATCHDOG_LEASE};
use super::{Contention, SubjectRounds};
use crate::report::{checked, figure, Figure, Report};
use crate::stats::{median, min_max};

/// A scenario name that lives as long as the program (a handful per run).
fn name(subject: Subject, row: &str) -> &'static str {
    Box::leak(format!("stores:{}:{row}", subject.key()).into_boxed_str())
}

/// The median of a list, and its smallest and largest, as three figures.
fn spread(label: &str, values: &[f64], unit: &'static str) -> Vec<Figure> {
    let (min, max) = min_max(values);
    vec![
        figure(format!("{label}, median"), median(values), unit),
        figure(format!("{label}, min of rounds"), min, unit),
        figure(format!("{label}, max of rounds"), max, unit),
    ]
}

pub(super) fn cycle(deployed: &Deployed, rounds: &SubjectRounds) -> Report {
    let floor = &deployed.probes[0];
    let (min, max) = min_max(&rounds.round_trips);
    let (rate_min, rate_max) = min_max(&rounds.cycle_rate);
    let mut details = vec![
        figure("round trips per cycle, min of rounds", min, ""),
        figure("round trips per cycle, max of rounds", max, ""),
        figure("cycles/s, min of rounds", rate_min, ""),
        figure("cycles/s, max of rounds", rate_max, ""),
    ];
    details.extend(spread(
        "round trips per cycle by p50 (cycle p50 ÷ floor p50)",
        &rounds.p50_round_trips,
        "",
    ));
    details.extend([
        figure(
            "round trips per cycle: all rounds' cycle p50 ÷ all rounds' floor p50",
            rounds.cycle_latency.micros(0.5) / floor.latency.micros(0.5),
            "",
        ),
        figure("lock+release p50", rounds.cycle_latency.micros(0.5), "µs"),
        figure(
            format!("{} p50", floor.label),
            floor.latency.micros(0.5),
            "µs",
        ),
    ]);
    for probe in &deployed.probes[1..] {
        details.push(figure(
            format!("{} p50", probe.label),
            probe.latency.micros(0.5),
            "µs",
        ));
        let per_round: Vec<f64> = floor
            .rate
            .iter()
            .zip(&probe.rate)
            .map(|(f, p)| f / p)
            .collect();
        details.push(figure(
            format!("{}: in round trips, median", probe.label),
            median(&per_round),
            "",
        ));
        details.push(figure(
            format!("{}: in round trips by p50, median", probe.label),
            median(&probe.p50_ratio),
            "",
        ));
    }
    if !rounds.try_round_trips.is_empty() {
        details.extend(spread(
            "try_acquire+release: round trips per cycle",
            &rounds.try_round_trips,
            "",
        ));
    }
    Report {
        scenario: name(rounds.subject, "cycle"),
        result: figure("cycles/s", median(&rounds.cycle_rate), ""),
        baseline: figure(
            format!("{} round trips/s =", floor.label),
            median(&floor.rate),
            "/s",
        ),
        ratio: median(&rounds.round_trips),
        target: "round trips per cycle".to_owned(),
        met: true,
        details,
    }
}

pub(super) fn contended(rounds: &SubjectRounds) -> Report {
    let runs = &rounds.contention;
    let pick = |f: fn(&Contention) -> f64| runs.iter().map(f).collect::<Vec<_>>();
    let (hold, rtt) = (median(&pick(|c| c.hold)), median(&pick(|c| c.rtt)));
    let overlaps: usize = runs.iter().map(|c| c.overlaps).sum();
    let regressions: usize = runs.iter().map(|c| c.token_regressions).sum();
    let mut details = Vec::new();
    let (min, max) = min_max(&pick(|c| c.ratio));
    details.push(figure("ratio to ideal, min of rounds", min, ""));
    details.push(figure("ratio to ideal, max of rounds", max, ""));
    details.extend(spread(
        "release→next acquire p50",
        &pick(|c| c.gap_p50),
        "µs",
    ));
    details.push(figure(
        "release→next acquire p99, median",
        median(&pick(|c| c.gap_p99)),
        "µs",
    ));
    details.extend(spread("Jain over 8 tasks", &pick(|c| c.jain), ""));
    details.push(figure("hold p50 (nominal 1000)", hold, "µs"));
    details.push(figure("store round trip p50", rtt, "µs"));
    details.push(checked(
        "overlapping holds (all rounds)",
        overlaps as f64,
        "",
        "0".to_owned(),
        overlaps == 0,
    ));
    if rounds.subject.has_token() {
        details.push(checked(
            "fencing tokens out of order (all rounds)",
            regressions as f64,
            "",
            "0".to_owned(),
            regressions == 0,
        ));
    }
    Report {
        scenario: name(rounds.subject, "contended"),
        result: figure("acquisitions/s", median(&pick(|c| c.rate)), ""),
        baseline: figure("ideal 1/(hold+RTT) =", 1e6 / (hold + rtt), "acq/s"),
        ratio: median(&pick(|c| c.ratio)),
        target: "reported".to_owned(),
        met: overlaps == 0 && regressions == 0,
        details,
    }
}

pub(super) fn kill(rounds: &SubjectRounds) -> Report {
    let lease_ms = WATCHDOG_LEASE.as_secs_f64() * 1e3;
    let time = median(&rounds.kill_ms);
    let (min, max) = min_max(&rounds.kill_ms);
    let mut details = vec![
        figure("kill -9 → next holder, min of rounds", min, "ms"),
        figure("kill -9 → next holder, max of rounds", max, "ms"),
    ];
    let lease = rounds.subject.has_lease();
    if !rounds.lease_left_ms.is_empty() {
        details.extend(spread(
            "lease left at the kill",
            &rounds.lease_left_ms,
            "ms",
        ));
        let past: Vec<f64> = rounds
            .kill_ms
            .iter()
            .zip(&rounds.lease_left_ms)
            .map(|(time, left)| time - left)
            .collect();
        details.extend(spread("past the lease left", &past, "ms"));
    }
    if lease && !rounds.subject.reads_lease_left() {
        details.push(figure(
            format!("lease left at the kill: {}", rounds.subject.lease_unread()),
            f64::NAN,
            "",
        ));
    }
    Report {
        scenario: name(rounds.subject, "kill9"),
        result: figure("kill -9 → next holder", time, "ms"),
        baseline: if lease {
            figure(rounds.subject.lease_label(), lease_ms, "ms")
        } else {
            figure("session lock, no lease:", 0.0, "ms")
        },
        ratio: if lease { time / lease_ms } else { f64::NAN },
        target: "reported".to_owned(),
        met: true,
        details,
    }
}

/// The one row of a subject this build lacks: it says which feature would build it.
pub(super) fn not_built(subject: Subject, feature: &str) -> Report {
    let why = format!("not built (feature {feature})");
    Report {
        scenario: name(subject, "not-built"),
        result: figure(why.clone(), f64::NAN, ""),
        baseline: figure(subject.label(), f64::NAN, ""),
        ratio: f64::NAN,
        target: why,
        met: true,
        details: Vec::new(),
    }
}

/// A number for the summary: no decimals from 100 up, three significant digits below.
fn num(value: f64) -> String {
    if !value.is_finite() {
        "–".to_owned()
    } else if value.abs() >= 100.0 {
        format!("{value:.0}")
    } else if value.abs() >= 10.0 {
        format!("{value:.1}")
    } else {
        format!("{value:.2}")
    }
}

/// Median (min–max).
fn ranged(values: &[f64]) -> String {
    let (min, max) = min_max(values);
    format!("{} ({}–{})", num(median(values)), num(min), num(max))
}

/// A baseline of a store, for the summary: "p50 µs; in round trips by rate; by p50".
fn probe_cell(deployed: &Deployed, label: &str) -> String {
    let floor = &deployed.probes[0];
    match deployed.probes.iter().find(|p| p.label == label) {
        Some(probe) => {
            let by_rate: Vec<f64> = floor
                .rate
                .iter()
                .zip(&probe.rate)
                .map(|(f, p)| f / p)
                .collect();
            format!(
                "p50 {} µs; {} by rate, {} by p50",
                num(probe.latency.micros(0.5)),
                ranged(&by_rate),
                ranged(&probe.p50_ratio)
            )
        }
        None => "–".to_owned(),
    }
}

/// The side-by-side table, in Markdown, one column per subject. A store's baselines are
/// shown under its first subject (distlock).
pub(super) fn summary(
    subjects: &[(usize, SubjectRounds)],
    deployed: &[Deployed],
    not_built: &[(Subject, &str)],
) -> String {
    // Every subject in store order, a subject not built in its place beside its store's.
    type Column<'a> = (Subject, Result<(&'a Deployed, &'a SubjectRounds), &'a str>);
    let mut columns: Vec<Column> = subjects
        .iter()
        .map(|(index, rounds)| (rounds.subject, Ok((&deployed[*index], rounds))))
        .chain(
            not_built
                .iter()
                .map(|&(subject, feature)| (subject, Err(feature))),
        )
        .collect();
    columns.sort_by_key(|(subject, _)| *subject);
    let mut rows: Vec<(String, Vec<String>)> = Vec::new();
    let mut row = |label: &str, cell: &dyn Fn(&Deployed, &SubjectRounds) -> String| {
        let cells = columns
            .iter()
            .map(|(_, column)| match column {
                Ok((deployed, rounds)) => cell(deployed, rounds),
                Err(feature) => format!("not built (feature {feature})"),
            })
            .collect();
        rows.push((label.to_owned(), cells));
    };
    let first = |d: &Deployed, r: &SubjectRounds| d.store.subjects().first() == Some(&r.subject);
    row("store round trip p50 (µs)", &|d, _| {
        format!(
            "{} ({})",
            num(d.probes[0].latency.micros(0.5)),
            d.probes[0].label
        )
    });
    let baselines: [(&str, &[&str]); 6] = [
        (
            "raw lock scripts / statements / Txns / requests, no library (a cycle)",
            &[RAW_SCRIPTS, RAW_STATEMENTS, RAW_TXNS, ZK_CYCLE],
        ),
        (
            "distlock's placement Txn alone, raw (etcd)",
            &[RAW_PLACEMENT],
        ),
        (
            "raw create + delete of an ephemeral sequential node (ZooKeeper)",
            &[ZK_PAIR],
        ),
        ("raw get_data of one node, a read (ZooKeeper)", &[ZK_GET]),
        ("SELECT 1 on sqlx's default pool (pinged first)", &[POOLED]),
        ("SELECT 1 on a pool without the ping", &[UNPINGED]),
    ];
    for (label, probes) in baselines {
        row(label, &|d, r| {
            if !first(d, r) {
                return "(same store)".to_owned();
            }
            probes
                .iter()
                .find(|label| d.probes.iter().any(|p| p.label == **label))
                .map_or_else(|| "–".to_owned(), |label| probe_cell(d, label))
        });
    }
    row("uncontended: cycles/s", &|_, r| ranged(&r.cycle_rate));
    row("uncontended: round trips per cycle, by rate", &|_, r| {
        ranged(&r.round_trips)
    });
    row("uncontended: round trips per cycle, by p50", &|_, r| {
        ranged(&r.p50_round_trips)
    });
    row("uncontended: cycle p50 (µs)", &|_, r| {
        num(r.cycle_latency.micros(0.5))
    });
    row(
        "uncontended: round trips per cycle, all rounds' p50 ÷ floor's",
        &|d, r| num(r.cycle_latency.micros(0.5) / d.probes[0].latency.micros(0.5)),
    );
    let contended = |f: fn(&Contention) -> f64| {
        move |_: &Deployed, r: &SubjectRounds| {
            ranged(&r.contention.iter().map(f).collect::<Vec<_>>())
        }
    };
    row(
        "8 tasks, 2 processes: acquisitions/s",
        &contended(|c| c.rate),
    );
    row(
        "8 tasks: ratio to ideal 1/(hold+RTT)",
        &contended(|c| c.ratio),
    );
    row("8 tasks: handoff p50 (µs)", &contended(|c| c.gap_p50));
    row("8 tasks: handoff p99 (µs)", &contended(|c| c.gap_p99));
    row("8 tasks: Jain", &contended(|c| c.jain));
    row(
        "8 tasks: overlapping holds, tokens out of order (all rounds)",
        &|_, r| {
            let overlaps: usize = r.contention.iter().map(|c| c.overlaps).sum();
            let regressions: usize = r.contention.iter().map(|c| c.token_regressions).sum();
            if r.subject.has_token() {
                format!("{overlaps}, {regressions}")
            } else {
                format!("{overlaps} (no tokens)")
            }
        },
    );
    row("kill -9 → next holder (ms)", &|_, r| ranged(&r.kill_ms));
    row("kill -9: past the lease left (ms)", &|_, r| {
        let past: Vec<f64> = r
            .kill_ms
            .iter()
            .zip(&r.lease_left_ms)
            .map(|(time, left)| time - left)
            .collect();
        if past.is_empty() {
            "–".to_owned()
        } else {
            ranged(&past)
        }
    });
    row("lease left at the kill (ms)", &|_, r| {
        if !r.subject.has_lease() {
            "no lease (session lock)".to_owned()
        } else if r.lease_left_ms.is_empty() {
            r.subject.lease_unread().to_owned()
        } else {
            ranged(&r.lease_left_ms)
        }
    });
    let labels: Vec<&str> = columns.iter().map(|(subject, _)| subject.label()).collect();
    let mut out = format!(
        "| | {} |\n|---|{}",
        labels.join(" | "),
        "---|".repeat(labels.len())
    );
    for (label, cells) in rows {
        out += &format!("\n| {label} | {} |", cells.join(" | "));
    }
    out
}
