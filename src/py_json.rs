//! Values as Python writes them: JSON as its `json` module writes it, and `str(float)`. Python writes the non-finite floats as the bare
//! tokens `NaN`, `Infinity` and `-Infinity`, which strict JSON lacks: diffusers' DPM-Solver
//! scheduler configs hold `"lambda_min_clipped": -Infinity`, so a model shipped with a DPM++
//! scheduler has a `scheduler_config.json` that strict parsers refuse. Outside strings, the
//! infinities read as the largest finite numbers of their sign and `NaN` as null; everything
//! else is strict JSON.

use std::borrow::Cow;

/// `text` with Python's non-finite tokens outside strings replaced (borrowed when it has none).
pub fn finite(text: &str) -> Cow<'_, str> {
    const TOKENS: [(&str, &str); 3] = [
        ("-Infinity", "-1.7976931348623157e308"),
        ("Infinity", "1.7976931348623157e308"),
        ("NaN", "null"),
    ];
    if !text.contains("Infinity") && !text.contains("NaN") {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 32);
    let mut in_string = false;
    let mut escaped = false;
    let mut rest = text;
    while let Some(c) = rest.chars().next() {
        if in_string {
            match (escaped, c) {
                (true, _) => escaped = false,
                (false, '\\') => escaped = true,
                (false, '"') => in_string = false,
                _ => {}
            }
        } else if c == '"' {
            in_string = true;
        } else if let Some((token, with)) = TOKENS.iter().find(|(t, _)| rest.starts_with(t)) {
            out.push_str(with);
            rest = &rest[token.len()..];
            continue;
        }
        out.push(c);
        rest = &rest[c.len_utf8()..];
    }
    Cow::Owned(out)
}

/// Python's `str(float)`: shortest round-trip digits; scientific (`1e-05`) when the decimal
/// exponent is < -4 or >= 16; otherwise positional with at least one decimal (`1.0`).
pub fn py_float(v: f64) -> String {
    if v.is_nan() {
        return "nan".to_string();
    }
    if v.is_infinite() {
        return if v > 0.0 { "inf" } else { "-inf" }.to_string();
    }
    if v == 0.0 {
        return if v.is_sign_negative() { "-0.0" } else { "0.0" }.to_string();
    }
    // `{:e}` gives the shortest round-trip mantissa, e.g. "1.5e-5".
    let sci = format!("{v:e}");
    let Some((mantissa, exp)) = sci.split_once('e') else {
        return sci;
    };
    let exp: i32 = exp.parse().unwrap_or(0);
    if (-4..16).contains(&exp) {
        let s = format!("{v}");
        if s.contains('.') {
            s
        } else {
            format!("{s}.0")
        }
    } else {
        let sign = if exp < 0 { '-' } else { '+' };
        format!("{mantissa}e{sign}{:02}", exp.abs())
    }
}

/// Python's `str(bool)`: `True` or `False`.
pub fn py_bool(b: bool) -> String {
    if b { "True" } else { "False" }.to_string()
}

/// A value as Python's `json.dumps` writes it ([`PyValue::dumps`]): dicts keep their insertion
/// order, as Python's do.
#[derive(Debug, Clone, PartialEq)]
pub enum PyValue {
    None,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
    List(Vec<PyValue>),
    Dict(Vec<(String, PyValue)>),
}

impl PyValue {
    /// `json.dumps(value)` with its defaults: `", "` and `": "` separators, ASCII-escaped
    /// strings, floats as `repr` writes them (`NaN` and `Infinity` for the non-finite ones).
    pub fn dumps(&self) -> String {
        let mut out = String::new();
        self.write(&mut out);
        out
    }

    fn write(&self, out: &mut String) {
        match self {
            PyValue::None => out.push_str("null"),
            PyValue::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            PyValue::Int(i) => out.push_str(&i.to_string()),
            PyValue::Float(f) if f.is_nan() => out.push_str("NaN"),
            PyValue::Float(f) if f.is_infinite() => {
                out.push_str(if *f > 0.0 { "Infinity" } else { "-Infinity" })
            }
            PyValue::Float(f) => out.push_str(&py_float(*f)),
            PyValue::Str(s) => out.push_str(&json_str(s)),
            PyValue::List(items) => {
                out.push('[');
                for (i, v) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    v.write(out);
                }
                out.push(']');
            }
            PyValue::Dict(entries) => {
                out.push('{');
                for (i, (k, v)) in entries.iter().enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    out.push_str(&json_str(k));
                    out.push_str(": ");
                    v.write(out);
                }
                out.push('}');
            }
        }
    }
}

/// A JSON string literal as Python's `json.dumps` writes it (`ensure_ascii`: every character
/// outside printable ASCII as `\uXXXX`, UTF-16 surrogate pairs beyond the BMP).
pub fn json_str(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (c as u32) > 0x7e => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// A boolean config field that may be null, read as Python reads it: null is false. diffusers
/// passes a config's null to the model's constructor as `None`, which its `if` tests take for
/// false (SDXL's `unet/config.json` holds `"upcast_attention": null`). Use with
/// `#[serde(default = "…", deserialize_with = "crate::py_json::null_is_false")]`: an absent
/// field still takes the constructor's default.
pub fn null_is_false<'de, D: serde::Deserializer<'de>>(d: D) -> Result<bool, D::Error> {
    Ok(<Option<bool> as serde::Deserialize>::deserialize(d)?.unwrap_or(false))
}

/// Parses `text` as JSON, reading Python's non-finite tokens ([`finite`]).
pub fn from_str<T: serde::de::DeserializeOwned>(text: &str) -> serde_json::Result<T> {
    serde_json::from_str(&finite(without_bom(text)))
}

/// For a type or value error of [`from_str`] on `text`, `": field `key`"`, naming the last object
/// key before where the error was found (serde_json's line and column), so a config's error names
/// its key as well as its file: `"layers_per_block": "abc"` is at `layers_per_block`. Empty for
/// syntax errors, a missing field (its message names it) or no key before the error.
pub fn field_at(text: &str, e: &serde_json::Error) -> String {
    let data = e.classify() == serde_json::error::Category::Data;
    if !data || e.line() == 0 || e.to_string().starts_with("missing field") {
        return String::new();
    }
    let text = without_bom(text);
    let line_start: usize = text
        .split_inclusive('\n')
        .take(e.line() - 1)
        .map(str::len)
        .sum();
    let end = (line_start + e.column()).min(text.len());
    let head = text.get(..end).unwrap_or(text);
    last_key(head).map_or_else(String::new, |k| format!(": field `{k}`"))
}

/// The last string in `head` that is followed by `:` (an object key).
fn last_key(head: &str) -> Option<String> {
    let (mut key, mut current, mut in_string, mut escaped) = (None, None::<String>, false, false);
    for c in head.chars() {
        match (in_string, escaped, c) {
            (true, true, _) => escaped = false,
            (true, false, '\\') => escaped = true,
            (true, false, '"') => in_string = false,
            (true, false, c) => current.get_or_insert_with(String::new).push(c),
            (false, _, '"') => {
                in_string = true;
                current = Some(String::new());
            }
            (false, _, ':') => key = current.take().or(key),
            (false, _, c) if !c.is_whitespace() => current = None,
            _ => {}
        }
    }
    key
}

/// `text` without a leading UTF-8 byte order mark (Windows editors write one; Python's `json`
/// refuses it, serde_json too).
pub fn without_bom(text: &str) -> &str {
    text.strip_prefix('\u{feff}').unwrap_or(text)
}

/// What a JSON value is, for errors ("a list", "a number", …).
pub fn kind(v: &serde_json::Value) -> &'static str {
    use serde_json::Value;
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    /// `PyValue::dumps` writes what Python's `json.dumps` writes for the same value (printed by
    /// `python3 -c 'import json; print(json.dumps({...}))'`). Catches compact separators, a
    /// non-ASCII character left raw, or Python's float repr lost.
    #[test]
    fn dumps_writes_what_pythons_json_writes() {
        let v = PyValue::Dict(vec![
            (
                "a".into(),
                PyValue::List(vec![
                    PyValue::Int(1),
                    PyValue::Float(2.5),
                    PyValue::None,
                    PyValue::Bool(true),
                    PyValue::Float(1e-5),
                    PyValue::Float(f64::INFINITY),
                ]),
            ),
            ("é".into(), PyValue::Str("x\"\n\u{8}\u{7f}\u{1F600}".into())),
            ("b".into(), PyValue::Dict(Vec::new())),
        ]);
        assert_eq!(
            v.dumps(),
            r#"{"a": [1, 2.5, null, true, 1e-05, Infinity], "\u00e9": "x\"\n\b\u007f\ud83d\ude00", "b": {}}"#
        );
    }

    /// A value of the wrong type names the key it sits under, on one line or many; a missing
    /// field or a syntax error adds nothing. Catches the key before the last one named, or a
    /// string value taken for a key.
    #[test]
    fn a_type_error_names_its_key() {
        #[derive(serde::Deserialize, Debug)]
        #[allow(dead_code)]
        struct C {
            a: String,
            n: Vec<usize>,
        }
        for text in [
            r#"{"a": "x:y", "n": [1, "abc"]}"#,
            "{\n  \"a\": \"x\",\n  \"n\": [1,\n 2, -1]\n}",
        ] {
            let e = from_str::<C>(text).unwrap_err();
            assert_eq!(field_at(text, &e), ": field `n`", "{text}");
        }
        let e = from_str::<C>(r#"{"a": 1, "n": []}"#).unwrap_err();
        assert_eq!(field_at(r#"{"a": 1, "n": []}"#, &e), ": field `a`");
        let e = from_str::<C>(r#"{"a": "x"}"#).unwrap_err();
        assert_eq!(field_at(r#"{"a": "x"}"#, &e), "");
        let e = from_str::<C>(r#"{"a": "#).unwrap_err();
        assert_eq!(field_at(r#"{"a": "#, &e), "");
    }

    /// What Python's `json.dumps` writes for a DPM-Solver config reads as the finite bounds, and
    /// the same tokens inside strings (and after escaped quotes) are left alone. Catches a
    /// replacement inside strings, or `-Infinity` read as `-` then `Infinity`.
    #[test]
    fn python_s_non_finite_tokens_read_outside_strings_only() {
        let text = r#"{"lambda_min_clipped": -Infinity, "x": Infinity, "y": [NaN, 1],
            "s": "NaN and -Infinity \" Infinity", "t": "caf\u00e9 Infinity"}"#;
        let v: Value = from_str(text).unwrap();
        assert_eq!(v["lambda_min_clipped"].as_f64(), Some(f64::MIN));
        assert_eq!(v["x"].as_f64(), Some(f64::MAX));
        assert_eq!(v["y"], serde_json::json!([null, 1]));
        assert_eq!(v["s"], "NaN and -Infinity \" Infinity");
        assert_eq!(v["t"], "café Infinity");
        assert!(matches!(finite(r#"{"a": 1}"#), Cow::Borrowed(_)));
        assert!(from_str::<Value>("{\"a\": Inf}").is_err());
    }
}
