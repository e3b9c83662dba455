//! Byte sizes in and out: "128M", "1.5GiB", "4k" parse to bytes; bytes
//! print with binary units.

pub use dmaload::parse_size;

/// A byte size on the command line: parsed by [`parse_size`] (the core's), shown in
/// the largest binary unit that holds it exactly ("128M"), so a default
/// taken from the core's constants reads in `--help` as one would write it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Size(pub u64);

impl std::str::FromStr for Size {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        parse_size(s).map(Size)
    }
}

impl std::fmt::Display for Size {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.0;
        for (shift, suffix) in [(40, "T"), (30, "G"), (20, "M"), (10, "K")] {
            if n != 0 && n % (1u64 << shift) == 0 {
                return write!(f, "{}{suffix}", n >> shift);
            }
        }
        write!(f, "{n}")
    }
}

/// Formats bytes with a binary unit, e.g. "1.50 GiB".
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.2} {}", UNITS[unit])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_print_as_they_parse() {
        for (bytes, text) in
            [(0, "0"), (4096, "4K"), (128 << 20, "128M"), (3 << 29, "1536M"), (1 << 40, "1T"), (4097, "4097")]
        {
            assert_eq!(Size(bytes).to_string(), text);
            assert_eq!(text.parse::<Size>(), Ok(Size(bytes)));
        }
    }

    #[test]
    fn bytes_print_in_binary_units() {
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(3 << 29), "1.50 GiB");
    }
}
