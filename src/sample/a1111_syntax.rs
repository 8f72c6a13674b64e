//! A1111's prompt emphasis, as kohya sd-scripts reads it in its sample prompts
//! (`library/lpw_stable_diffusion.py` and `library/strategy_base.py`: `parse_prompt_attention`):
//! - `(words)` multiplies their weight by 1.1, `[words]` by 1/1.1, `(words:1.3)` by 1.3; brackets
//!   nest and their factors multiply; an unclosed bracket applies to the rest of the prompt;
//! - `\(`, `\)`, `\[`, `\]`, `\\` are the characters; a backslash before anything else is
//!   dropped;
//! - neighbouring pieces of equal weight are joined (without a space: the text is kept as
//!   written, brackets removed).
//!
//! The text is split as kohya's regex splits it
//! (`\\\(|\\\)|\\\[|\\]|\\\\|\\|\(|\[|:([+-]?[.\d]+)\)|\)|]|[^\\()\[\]:]+|:`).

/// Parses `text` into pieces and their weights. `Err` when a weight is not a number Python's
/// `float` reads (kohya stops there).
pub fn parse(text: &str) -> Result<Vec<(String, f64)>, String> {
    let mut res: Vec<(String, f64)> = Vec::new();
    let mut round: Vec<usize> = Vec::new();
    let mut square: Vec<usize> = Vec::new();
    let multiply = |res: &mut Vec<(String, f64)>, from: usize, m: f64| {
        for r in res.iter_mut().skip(from) {
            r.1 *= m;
        }
    };
    for token in tokens(text) {
        match token {
            Token::Escaped(c) => res.push((c, 1.0)),
            Token::Open('(') => round.push(res.len()),
            Token::Open(_) => square.push(res.len()),
            Token::Weight(w, raw) if !round.is_empty() => {
                let w: f64 = w
                    .parse()
                    .map_err(|_| format!("`{raw}`: the weight is not a number"))?;
                let from = round.pop().unwrap_or(0);
                multiply(&mut res, from, w);
            }
            Token::Close(')') if !round.is_empty() => {
                let from = round.pop().unwrap_or(0);
                multiply(&mut res, from, 1.1);
            }
            Token::Close(']') if !square.is_empty() => {
                let from = square.pop().unwrap_or(0);
                multiply(&mut res, from, 1.0 / 1.1);
            }
            Token::Weight(_, raw) => res.push((raw, 1.0)),
            Token::Close(c) => res.push((c.to_string(), 1.0)),
            Token::Text(t) => res.push((t, 1.0)),
        }
    }
    for from in round {
        multiply(&mut res, from, 1.1);
    }
    for from in square {
        multiply(&mut res, from, 1.0 / 1.1);
    }
    if res.is_empty() {
        res.push((String::new(), 1.0));
    }
    let mut merged: Vec<(String, f64)> = Vec::with_capacity(res.len());
    for (t, w) in res {
        match merged.last_mut() {
            Some(last) if last.1 == w => last.0.push_str(&t),
            _ => merged.push((t, w)),
        }
    }
    Ok(merged)
}

/// Whether `text` uses A1111's weighted form `(text:1.2)`, which compel's syntax reads as text.
pub fn has_explicit_weight(text: &str) -> bool {
    tokens(text)
        .iter()
        .any(|t| matches!(t, Token::Weight(w, _) if w.parse::<f64>().is_ok()))
}

enum Token {
    /// A backslash and what it escapes (the escaped text, without the backslash).
    Escaped(String),
    Open(char),
    Close(char),
    /// `:w)`: the number as written, and the whole match.
    Weight(String, String),
    Text(String),
}

fn tokens(text: &str) -> Vec<Token> {
    let s: Vec<char> = text.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < s.len() {
        let c = s[i];
        match c {
            '\\' => match s.get(i + 1) {
                Some(&n @ ('(' | ')' | '[' | ']' | '\\')) => {
                    out.push(Token::Escaped(n.to_string()));
                    i += 2;
                }
                _ => {
                    out.push(Token::Escaped(String::new()));
                    i += 1;
                }
            },
            '(' | '[' => {
                out.push(Token::Open(c));
                i += 1;
            }
            ')' | ']' => {
                out.push(Token::Close(c));
                i += 1;
            }
            ':' => {
                let mut j = i + 1;
                if matches!(s.get(j), Some('+' | '-')) {
                    j += 1;
                }
                let digits = j;
                while s.get(j).is_some_and(|c| *c == '.' || c.is_ascii_digit()) {
                    j += 1;
                }
                if j > digits && s.get(j) == Some(&')') {
                    let number: String = s[i + 1..j].iter().collect();
                    let raw: String = s[i..=j].iter().collect();
                    out.push(Token::Weight(number, raw));
                    i = j + 1;
                } else {
                    out.push(Token::Text(":".into()));
                    i += 1;
                }
            }
            _ => {
                let start = i;
                while s
                    .get(i)
                    .is_some_and(|c| !matches!(c, '\\' | '(' | ')' | '[' | ']' | ':'))
                {
                    i += 1;
                }
                out.push(Token::Text(s[start..i].iter().collect()));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(text: &str) -> Vec<(String, f64)> {
        parse(text).unwrap()
    }

    /// The examples of kohya's (A1111's) docstring.
    #[test]
    fn docstring_examples() {
        assert_eq!(p("normal text"), vec![("normal text".into(), 1.0)]);
        assert_eq!(
            p("an (important) word"),
            vec![
                ("an ".into(), 1.0),
                ("important".into(), 1.1),
                (" word".into(), 1.0)
            ]
        );
        assert_eq!(p("(unbalanced"), vec![("unbalanced".into(), 1.1)]);
        assert_eq!(p("\\(literal\\]"), vec![("(literal]".into(), 1.0)]);
        assert_eq!(
            p("(unnecessary)(parens)"),
            vec![("unnecessaryparens".into(), 1.1)]
        );
        let got = p("a (((house:1.3)) [on] a (hill:0.5), sun, (((sky))).");
        let want = [
            ("a ", 1.0),
            ("house", 1.5730000000000004),
            (" ", 1.1),
            ("on", 1.0),
            (" a ", 1.1),
            ("hill", 0.55),
            (", sun, ", 1.1),
            ("sky", 1.4641000000000006),
            (".", 1.1),
        ];
        assert_eq!(got.len(), want.len(), "{got:?}");
        for ((t, w), (wt, ww)) in got.iter().zip(want) {
            assert_eq!(t, wt);
            assert!((w - ww).abs() < 1e-12, "{t}: {w} vs {ww}");
        }
    }

    #[test]
    fn odd_input() {
        // A lone backslash is dropped; a colon without a closing weight is text.
        assert_eq!(p("a\\b: c"), vec![("ab: c".into(), 1.0)]);
        assert_eq!(p("x:1.2) y"), vec![("x:1.2) y".into(), 1.0)]);
        assert!(parse("(a:1..2)").is_err());
        assert_eq!(p(""), vec![(String::new(), 1.0)]);
        assert!(has_explicit_weight("(masterpiece:1.2), 1girl"));
        assert!(!has_explicit_weight("a (cat)1.2, 12:30"));
    }
}
