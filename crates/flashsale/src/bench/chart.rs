//! The benchmark's chart: median requests per second of each target, as an SVG bar chart
//! for docs/benchmarks.md.

use std::path::Path;

use plotters::prelude::*;

use super::BenchReport;

/// Draws `report` to `path`.
pub fn draw(
    report: &BenchReport,
    path: &Path,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let root = SVGBackend::new(path, (720, 400)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let top = report.targets.iter().map(|t| t.rps).fold(0.0, f64::max) * 1.15;
    let names: Vec<String> = report.targets.iter().map(|t| t.target.clone()).collect();
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!(
                "flashsale: requests/s at {} connections (median of {} rounds)",
                report.connections, report.rounds
            ),
            ("sans-serif", 18),
        )
        .margin(16)
        .x_label_area_size(36)
        .y_label_area_size(64)
        .build_cartesian_2d((0..names.len()).into_segmented(), 0.0..top.max(1.0))
        .map_err(|e| e.to_string())?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(names.len())
        .x_label_formatter(&|segment| match segment {
            SegmentValue::CenterOf(i) => names.get(*i).cloned().unwrap_or_default(),
            _ => String::new(),
        })
        .y_desc("requests/s")
        .draw()
        .map_err(|e| e.to_string())?;
    let palette = [
        RGBColor(120, 120, 120),
        RGBColor(31, 119, 180),
        RGBColor(255, 127, 14),
        RGBColor(44, 160, 44),
        RGBColor(214, 39, 40),
    ];
    chart
        .draw_series(report.targets.iter().enumerate().map(|(i, target)| {
            let color = palette[i % palette.len()];
            Rectangle::new(
                [
                    (SegmentValue::Exact(i), 0.0),
                    (SegmentValue::Exact(i + 1), target.rps),
                ],
                color.mix(0.85).filled(),
            )
        }))
        .map_err(|e| e.to_string())?;
    chart
        .draw_series(report.targets.iter().enumerate().map(|(i, target)| {
            Text::new(
                format!("{:.0}", target.rps),
                (SegmentValue::CenterOf(i), target.rps),
                ("sans-serif", 14),
            )
        }))
        .map_err(|e| e.to_string())?;
    root.present().map_err(|e| e.to_string())?;
    Ok(())
}
