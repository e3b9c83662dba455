//! Byte sizes in and out: "128M", "1.5GiB", "4k" parse to bytes; bytes
//! print with binary units.

/// Parses a size with an optional binary suffix (K, M, G, T; "iB"/"B"
/// optional, case-insensitive). Fractions are allowed where they make
/// whole bytes: "1.5G", not "0.1K" (102.4 bytes) nor "0.0000001k" (which
/// would round to 0). Every size option of the CLI parses with this one.
pub fn parse_size(text: &str) -> Result<u64, String> {
    let s = text.trim();
    let digits_end = s.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(s.len());
    let (number, suffix) = s.split_at(digits_end);
    let value: f64 = number.parse().map_err(|_| format!("invalid size {text:?}"))?;
    let shift = match suffix.trim().to_ascii_lowercase().trim_end_matches("ib").trim_end_matches('b') {
        "" => 0,
        "k" => 10,
        "m" => 20,
        "g" => 30,
        "t" => 40,
        other => return Err(format!("invalid size suffix {other:?} in {text:?} (use K, M, G or T)")),
    };
    let bytes = value * (1u64 << shift) as f64;
    if !bytes.is_finite() || bytes < 0.0 || bytes > u64::MAX as f64 {
        return Err(format!("size {text:?} out of range"));
    }
    if bytes.fract() != 0.0 {
        return Err(format!("size {text:?} is {bytes} bytes, not a whole number of bytes"));
    }
    Ok(bytes as u64)
}

/// A byte size on the command line: parsed by [`parse_size`], shown in
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
    fn sizes_parse_with_binary_suffixes() {
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("4k").unwrap(), 4096);
        assert_eq!(parse_size("128MiB").unwrap(), 128 << 20);
        assert_eq!(parse_size("1.5G").unwrap(), 3 << 29);
        assert_eq!(parse_size("2gb").unwrap(), 2 << 30);
        assert!(parse_size("12x").is_err());
        assert!(parse_size("").is_err());
        assert_eq!(parse_size("0.5M").unwrap(), 512 << 10);
    }

    #[test]
    fn a_size_of_part_of_a_byte_is_an_error_not_rounded() {
        // Issue 34: "0.0000001k" loaded 0 bytes.
        for text in ["0.0000001k", "0.1K", "1.5"] {
            let err = parse_size(text).unwrap_err();
            assert!(err.contains("not a whole number of bytes"), "{text}: {err}");
        }
    }

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
