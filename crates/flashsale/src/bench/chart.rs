//! The benchmark's chart: median requests per second of each target, as an SVG bar chart
//! for docs/benchmarks.md.

use std::path::Path;

use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use super::BenchReport;

const PALETTE: [RGBColor; 5] = [
    RGBColor(130, 130, 130),
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
];

/// Draws `report` to `path`.
pub fn draw(
    report: &BenchReport,
    path: &Path,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let root = SVGBackend::new(path, (720, 400)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let top = report.targets.iter().map(|t| t.rps).fold(1.0, f64::max) * 1.15;
    let count = report.targets.len();
    let names: Vec<String> = report.targets.iter().map(|t| t.target.clone()).collect();
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!(
                "flashsale: requests/s at {} connections, median of {} rounds",
                report.connections, report.rounds
            ),
            ("sans-serif", 18),
        )
        .margin(16)
        .x_label_area_size(32)
        .y_label_area_size(64)
        .build_cartesian_2d(0.0..count as f64, 0.0..top)
        .map_err(|e| e.to_string())?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .y_max_light_lines(0)
        .x_labels(count * 2 + 1)
        .x_label_formatter(&|x| {
            // Label only the bar centres (i + 0.5).
            let slot = x - 0.5;
            if (slot - slot.round()).abs() < 1e-6 && slot >= 0.0 {
                names
                    .get(slot.round() as usize)
                    .cloned()
                    .unwrap_or_default()
            } else {
                String::new()
            }
        })
        .y_label_formatter(&|y| format!("{y:.0}"))
        .y_desc("requests/s")
        .draw()
        .map_err(|e| e.to_string())?;
    chart
        .draw_series(report.targets.iter().enumerate().map(|(i, target)| {
            let x = i as f64;
            Rectangle::new(
                [(x + 0.15, 0.0), (x + 0.85, target.rps)],
                PALETTE[i % PALETTE.len()].filled(),
            )
        }))
        .map_err(|e| e.to_string())?;
    let above = ("sans-serif", 14)
        .into_font()
        .color(&BLACK)
        .pos(Pos::new(HPos::Center, VPos::Bottom));
    chart
        .draw_series(report.targets.iter().enumerate().map(|(i, target)| {
            Text::new(
                format!("{:.0}", target.rps),
                (i as f64 + 0.5, target.rps + top * 0.01),
                above.clone(),
            )
        }))
        .map_err(|e| e.to_string())?;
    root.present().map_err(|e| e.to_string())?;
    Ok(())
}
