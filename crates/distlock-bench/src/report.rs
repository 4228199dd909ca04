//! What a scenario measured, printed as a table row or as one JSON object.

use serde::Serialize;

/// The outcome of one scenario.
#[derive(Debug, Serialize)]
pub struct Report {
    pub scenario: &'static str,
    /// The headline figure, e.g. lock cycles per second.
    pub result: Figure,
    /// What the same run measured to compare it with.
    pub baseline: Figure,
    /// `result` relative to what the baseline allows (1.0 = as good as possible).
    pub ratio: f64,
    /// The ratio the issue asks for, as text ("ratio >= 0.90").
    pub target: String,
    pub met: bool,
    /// Further figures of the scenario.
    pub details: Vec<Figure>,
}

#[derive(Debug, Serialize)]
pub struct Figure {
    pub name: String,
    pub value: f64,
    pub unit: &'static str,
    /// A target this figure is held to, if any, and whether it was met.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub target: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub met: Option<bool>,
}

pub fn figure(name: impl Into<String>, value: f64, unit: &'static str) -> Figure {
    Figure {
        name: name.into(),
        value,
        unit,
        target: None,
        met: None,
    }
}

/// A figure held to a target.
pub fn checked(
    name: impl Into<String>,
    value: f64,
    unit: &'static str,
    target: String,
    met: bool,
) -> Figure {
    Figure {
        target: Some(target),
        met: Some(met),
        ..figure(name, value, unit)
    }
}

impl Figure {
    fn text(&self) -> String {
        let value = if self.value.abs() >= 100.0 {
            format!("{:.0}", self.value)
        } else {
            format!("{:.3}", self.value)
        };
        let mut text = format!("{} {value} {}", self.name, self.unit);
        if let (Some(target), Some(met)) = (&self.target, self.met) {
            text += &format!(
                "  (target {target}: {})",
                if met { "met" } else { "MISSED" }
            );
        }
        text
    }
}

pub fn print_header() {
    println!(
        "{:<12} {:<34} {:<38} {:>7}  {:<22} met",
        "scenario", "result", "baseline (same run)", "ratio", "target"
    );
}

pub fn print_row(report: &Report) {
    println!(
        "{:<12} {:<34} {:<38} {:>7.3}  {:<22} {}",
        report.scenario,
        report.result.text(),
        report.baseline.text(),
        report.ratio,
        report.target,
        if report.met { "yes" } else { "NO" }
    );
    for detail in &report.details {
        println!("{:<12}   {}", "", detail.text());
    }
}
