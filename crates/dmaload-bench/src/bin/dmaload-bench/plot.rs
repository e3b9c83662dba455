//! `--plot out.png`: the benchmark tables as horizontal bar charts (median
//! bar, min–max whisker), drawn with plotters into a PNG.

use std::path::Path;
use std::sync::Once;

use plotters::coord::ranged1d::SegmentValue;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use crate::benchkit::Spread;

/// One bar: a label and the spread of its samples.
pub struct Bar {
    pub label: String,
    pub spread: Spread,
}

/// One chart of bars sharing a unit.
pub struct Panel {
    pub title: String,
    pub unit: String,
    pub bars: Vec<Bar>,
}

const FONT: &str = "sans-serif";
const BAR_HEIGHT: u32 = 24;
const WIDTH: u32 = 1200;

/// The embedded DejaVu Sans, registered once (plotters' ab_glyph backend
/// draws no text without a registered font).
fn register_font() -> Result<(), String> {
    static ONCE: Once = Once::new();
    let mut result = Ok(());
    ONCE.call_once(|| {
        result = plotters::style::register_font(FONT, FontStyle::Normal, dejavu::sans::regular())
            .map_err(|_| "the embedded font is invalid".to_string());
    });
    result
}

fn panel_height(panel: &Panel) -> u32 {
    panel.bars.len().max(1) as u32 * BAR_HEIGHT + 90
}

/// Draws `panels` one above the other under `title` into a PNG at `path`
/// (drawn in memory, then written as every file dmaload creates is:
/// [`dmaload::tmpfile::write_file`], never through a symlink planted at
/// `path`).
pub fn bar_chart(path: &Path, title: &str, panels: &[Panel]) -> Result<(), String> {
    register_font()?;
    let height = 50 + panels.iter().map(panel_height).sum::<u32>();
    let fail = |e: &dyn std::fmt::Display| format!("plot {}: {e}", path.display());
    let mut pixels = vec![0u8; WIDTH as usize * height as usize * 3];
    {
        let root = BitMapBackend::with_buffer(&mut pixels, (WIDTH, height)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| fail(&e))?;
        let root = root.titled(title, (FONT, 24)).map_err(|e| fail(&e))?;
        let mut rest = root;
        for panel in panels {
            let (area, below) = rest.split_vertically(panel_height(panel));
            rest = below;
            draw_panel(&area, panel).map_err(|e| fail(&e))?;
        }
        rest.present().map_err(|e| fail(&e))?;
    }
    let mut png = Vec::new();
    let mut encoder = png::Encoder::new(&mut png, WIDTH, height);
    encoder.set_color(png::ColorType::Rgb);
    encoder.set_depth(png::BitDepth::Eight);
    encoder.write_header().and_then(|mut w| w.write_image_data(&pixels)).map_err(|e| fail(&e))?;
    dmaload::tmpfile::write_file(path, &png, 0o644).map_err(|e| e.to_string())
}

fn draw_panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    panel: &Panel,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    let n = panel.bars.len().max(1);
    let top = panel.bars.iter().map(|b| b.spread.max).fold(0.0, f64::max).max(1e-9) * 1.15;
    let mut chart = ChartBuilder::on(area)
        .caption(&panel.title, (FONT, 18))
        .margin(10)
        .x_label_area_size(36)
        .y_label_area_size(360)
        .build_cartesian_2d(0.0..top, (0..n).into_segmented())?;
    let labels: Vec<String> = panel.bars.iter().map(|b| b.label.clone()).collect();
    // The first bar (the baseline) on top, as in the tables.
    let row = |i: usize| n - 1 - i;
    chart
        .configure_mesh()
        .disable_y_mesh()
        .y_labels(n)
        .y_label_formatter(&|v| match v {
            SegmentValue::CenterOf(i) if *i < n => labels[row(*i)].clone(),
            _ => String::new(),
        })
        .x_desc(panel.unit.as_str())
        .label_style((FONT, 14))
        .axis_desc_style((FONT, 15))
        .draw()?;
    let colors = [RGBColor(66, 114, 196), RGBColor(237, 125, 49)];
    chart.draw_series(panel.bars.iter().enumerate().map(|(i, bar)| {
        let color = colors[usize::from(i == 0)];
        let mut rect = Rectangle::new(
            [(0.0, SegmentValue::Exact(row(i))), (bar.spread.median, SegmentValue::Exact(row(i) + 1))],
            color.filled(),
        );
        rect.set_margin(3, 3, 0, 0);
        rect
    }))?;
    chart.draw_series(panel.bars.iter().enumerate().map(|(i, bar)| {
        PathElement::new(
            vec![
                (bar.spread.min, SegmentValue::CenterOf(row(i))),
                (bar.spread.max, SegmentValue::CenterOf(row(i))),
            ],
            BLACK.stroke_width(2),
        )
    }))?;
    chart.draw_series(panel.bars.iter().enumerate().map(|(i, bar)| {
        Text::new(
            format!(" {}", short(bar.spread.median)),
            (bar.spread.max, SegmentValue::CenterOf(row(i))),
            TextStyle::from((FONT, 13).into_font()).pos(Pos::new(HPos::Left, VPos::Center)),
        )
    }))?;
    Ok(())
}

/// A value with as many decimals as its size deserves.
fn short(v: f64) -> String {
    match v.abs() {
        a if a >= 100.0 => format!("{v:.0}"),
        a if a >= 10.0 => format!("{v:.1}"),
        _ => format!("{v:.2}"),
    }
}
