//! SVG plots of a spec's run: the latency distribution and IOPS over time.

use std::path::Path;

use plotters::prelude::*;

use super::stats::SpecResult;

const WIDTH: u32 = 900;
const HEIGHT: u32 = 480;

fn err(e: impl std::fmt::Display) -> String {
    e.to_string()
}

/// Draws the latency distribution of `result` (I/Os per latency bucket,
/// buckets doubling from 1 µs) to an SVG file.
///
/// # Errors
/// A message if drawing or writing failed.
pub fn latency_histogram(result: &SpecResult, path: &Path) -> Result<(), String> {
    let buckets = &result.latency_distribution;
    let root = SVGBackend::new(path, (WIDTH, HEIGHT)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let max = buckets.iter().map(|b| b.count).max().unwrap_or(1).max(1);
    let n = buckets.len().max(1);
    let labels: Vec<String> = buckets
        .iter()
        .map(|b| {
            if b.upto_us >= 1000.0 {
                format!("{:.3} ms", b.upto_us / 1000.0)
            } else {
                format!("{:.0} us", b.upto_us)
            }
        })
        .collect();
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!(
                "{}: latency distribution ({} I/Os)",
                result.spec, result.rates.ios
            ),
            ("sans-serif", 20),
        )
        .margin(12)
        .x_label_area_size(60)
        .y_label_area_size(70)
        // A log scale: the rare slow I/Os of the tail stay visible beside
        // the millions of fast ones.
        .build_cartesian_2d(
            0u32..u32::try_from(n).unwrap_or(u32::MAX),
            (1f64..max as f64 * 2.0).log_scale(),
        )
        .map_err(err)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_desc("latency, up to (bucket upper bound)")
        .y_desc("I/Os (log scale)")
        .y_label_formatter(&|v| format!("{v:.0}"))
        .x_labels(n.min(16))
        .x_label_formatter(&|i| labels.get(*i as usize).cloned().unwrap_or_default())
        .draw()
        .map_err(err)?;
    chart
        .draw_series(buckets.iter().enumerate().map(|(i, b)| {
            let i = u32::try_from(i).unwrap_or(u32::MAX);
            Rectangle::new(
                [(i, 1.0), (i + 1, b.count.max(1) as f64)],
                BLUE.mix(0.6).filled(),
            )
        }))
        .map_err(err)?;
    root.present().map_err(err)?;
    Ok(())
}

/// Draws IOPS over time (the ramp-up shaded) to an SVG file.
///
/// # Errors
/// A message if drawing or writing failed.
pub fn iops_over_time(result: &SpecResult, path: &Path) -> Result<(), String> {
    let t = &result.timeline;
    let iops = t.iops();
    let secs = t.bucket_ms as f64 / 1000.0;
    let end = (iops.len() as f64 * secs).max(secs);
    let top = iops.iter().copied().fold(0.0f64, f64::max).max(1.0) * 1.1;
    let root = SVGBackend::new(path, (WIDTH, HEIGHT)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!(
                "{}: IOPS over time ({} ms buckets; ramp-up shaded)",
                result.spec, t.bucket_ms
            ),
            ("sans-serif", 20),
        )
        .margin(12)
        .x_label_area_size(45)
        .y_label_area_size(80)
        .build_cartesian_2d(0f64..end, 0f64..top)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("seconds since the ramp-up began")
        .y_desc("IOPS")
        .y_label_formatter(&|v| format!("{v:.0}"))
        .draw()
        .map_err(err)?;
    let ramp_end = t.ramp_buckets as f64 * secs;
    if ramp_end > 0.0 {
        chart
            .draw_series(std::iter::once(Rectangle::new(
                [(0.0, 0.0), (ramp_end, top)],
                BLACK.mix(0.08).filled(),
            )))
            .map_err(err)?;
    }
    chart
        .draw_series(LineSeries::new(
            iops.iter()
                .enumerate()
                .map(|(i, &v)| ((i as f64 + 0.5) * secs, v)),
            RED.stroke_width(2),
        ))
        .map_err(err)?;
    root.present().map_err(err)?;
    Ok(())
}
