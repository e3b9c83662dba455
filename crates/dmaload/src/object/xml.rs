//! The little of XML that S3's and STS's answers need: the text of an
//! element found by name (their bodies are small, flat enough, and never
//! hold the same element name at two depths that matter).

/// The text of the first `<name>` element of `body`, entities decoded.
pub fn field(body: &str, name: &str) -> Option<String> {
    let start = body.find(&format!("<{name}>"))? + name.len() + 2;
    let end = start + body[start..].find(&format!("</{name}>"))?;
    let text = body[start..end].trim();
    (!text.is_empty())
        .then(|| text.replace("&quot;", "\"").replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&"))
}
