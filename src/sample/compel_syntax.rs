//! Prompt weighting as EveryDream2's samples read it: the syntax of compel 1.1
//! (`compel/prompt_parser.py`, which EveryDream2's `utils/sample_generator.py` runs every sample
//! prompt through):
//! - `word+`, `word++`, `word-`: the word's weight times 1.1 per `+`, 0.9 per `-`;
//! - `(several words)1.3`, `"quoted words"0.8`, `(words)+`: a group's weight; groups nest and
//!   their weights multiply; `(words).attend(1.3)` says the same;
//! - `\(`, `\)`, `\"`: literal characters; a group's parentheses and quotes are not text;
//! - `("a cat", "a dog").blend(0.7, 0.3)`: the weighted mean of each prompt's conditioning
//!   (`, no_normalize` last: the weights as given, not divided by their sum).
//!
//! Parsing yields fragments of text with their weights, exactly as compel's parser and its
//! `flatten` do (neighbouring fragments of equal weight joined by a space); the text of a
//! fragment is what the tokenizer reads. The parser is a port of compel's pyparsing grammar,
//! including where pyparsing skips whitespace, so odd input reads as compel reads it
//! (`tests/fixtures/compel_syntax_reference.py` checks a corpus of prompts against compel).
//!
//! compel's other operators are refused, since sdtrain's samples cannot honour them:
//! `.and()`/`.add()` (conjunctions, which compel itself refuses), `.swap()` (cross-attention
//! control, which compel drops) and `withLora(…)`/`useLora(…)` (a LoRA named in the prompt,
//! which compel leaves to its caller).

use std::cell::RefCell;
use std::collections::HashMap;

/// A piece of prompt text and its weight.
#[derive(Debug, Clone, PartialEq)]
pub struct Fragment {
    pub text: String,
    pub weight: f64,
}

/// A parsed prompt.
#[derive(Debug, Clone, PartialEq)]
pub enum WeightedPrompt {
    /// One prompt's fragments.
    Fragments(Vec<Fragment>),
    /// `(…).blend(…)`: several prompts' conditionings mixed with `weights` (divided by their sum
    /// when `normalize`).
    Blend {
        prompts: Vec<Vec<Fragment>>,
        weights: Vec<f64>,
        normalize: bool,
    },
}

impl WeightedPrompt {
    /// Whether the conditioning is the plain encoding of `text`: one fragment of weight 1 whose
    /// text reads as the prompt's own tokens.
    pub fn plain_text(&self) -> Option<&str> {
        match self {
            WeightedPrompt::Fragments(f) if f.len() == 1 && f[0].weight == 1.0 => Some(&f[0].text),
            _ => None,
        }
    }
}

/// The most `(` and `"` a prompt may hold.
const MAX_GROUPS: usize = 200;

/// Parses `prompt` as compel does. `Err` says why compel's parse fails or what sdtrain refuses.
pub fn parse(prompt: &str) -> Result<WeightedPrompt, String> {
    let prompt = space_after_commas(prompt);
    if prompt.trim().is_empty() {
        return Ok(WeightedPrompt::Fragments(vec![Fragment {
            text: String::new(),
            weight: 1.0,
        }]));
    }
    let chars: Vec<char> = prompt.chars().collect();
    // Groups are parsed recursively; a bound on them bounds the stack.
    let groups = chars.iter().filter(|&&c| c == '(' || c == '"').count();
    if groups > MAX_GROUPS {
        return Err(format!(
            "{groups} parentheses and quotes; at most {MAX_GROUPS} are read"
        ));
    }
    let g = Grammar::new(&chars);
    if g.conjunction(0)?.is_some() {
        return Err(
            "compel's `.and()`/`.add()` (a conjunction of prompts) is not supported in samples"
                .into(),
        );
    }
    let (_, root) = g.implicit_conjunction()?.ok_or_else(|| {
        "compel's prompt syntax cannot read it (a character it does not accept, or a `.blend()` \
         followed by more text)"
            .to_string()
    })?;
    match root {
        Node::Blend(parts, weights, normalize) => {
            let mut prompts = Vec::new();
            for p in parts {
                let f = flatten(&p)?;
                if !f.is_empty() {
                    prompts.push(f);
                }
            }
            if prompts.len() != weights.len() {
                return Err(format!(
                    "`.blend()` has {} prompts and {} weights",
                    prompts.len(),
                    weights.len()
                ));
            }
            Ok(WeightedPrompt::Blend {
                prompts,
                weights,
                normalize,
            })
        }
        Node::Group(nodes) => {
            let f = flatten(&nodes)?;
            if f.is_empty() {
                return Err("the prompt has no text".into());
            }
            Ok(WeightedPrompt::Fragments(f))
        }
        _ => Err("compel's prompt syntax cannot read it".into()),
    }
}

/// compel's `re.sub(r',(\S)', r', \1', prompt)`.
fn space_after_commas(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut it = s.chars().peekable();
    while let Some(c) = it.next() {
        out.push(c);
        if c == ',' {
            // The match consumes the character after the comma, so `,,x` becomes `, ,x`.
            if let Some(n) = it.next_if(|n| !n.is_whitespace()) {
                out.push(' ');
                out.push(n);
            }
        }
    }
    out
}

#[derive(Debug, Clone)]
enum Node {
    Text(String),
    Attention(f64, Vec<Node>),
    Group(Vec<Node>),
    Blend(Vec<Vec<Node>>, Vec<f64>, bool),
    Swap,
    Lora,
}

/// Walks the tree as compel's `flatten`: weights multiply down the nesting, and neighbouring
/// fragments of equal weight are joined by a space.
fn flatten(nodes: &[Node]) -> Result<Vec<Fragment>, String> {
    fn walk(nodes: &[Node], scale: f64, out: &mut Vec<Fragment>) -> Result<(), String> {
        for n in nodes {
            match n {
                // compel makes a new `Fragment` here, which unescapes its text once more.
                Node::Text(t) => out.push(Fragment {
                    text: unescape(t),
                    weight: 1.0 * scale,
                }),
                Node::Attention(w, children) => walk(children, scale * w, out)?,
                Node::Group(children) => walk(children, scale, out)?,
                Node::Swap => {
                    return Err(
                        "compel's `.swap()` (cross-attention control) is not supported \
                                in samples"
                            .into(),
                    )
                }
                Node::Lora => {
                    return Err(
                        "compel's `withLora(…)`/`useLora(…)` is not supported in samples; \
                                give the LoRA with `--lora`"
                            .into(),
                    )
                }
                Node::Blend(..) => {
                    return Err("a `.blend()` inside a prompt is not supported".into())
                }
            }
        }
        Ok(())
    }
    let mut raw = Vec::new();
    walk(nodes, 1.0, &mut raw)?;
    let mut fused: Vec<Fragment> = Vec::new();
    for f in raw {
        match fused.last_mut() {
            Some(last) if last.weight == f.weight => {
                last.text = unescape(&format!("{} {}", last.text, f.text));
            }
            _ => fused.push(f),
        }
    }
    Ok(fused)
}

/// compel's `Fragment`: `\(`, `\)` and `\"` become the character.
fn unescape(t: &str) -> String {
    if t.contains("\\\"") || t.contains("\\(") || t.contains("\\)") {
        t.replace("\\(", "(")
            .replace("\\)", ")")
            .replace("\\\"", "\"")
    } else {
        t.to_string()
    }
}

/// The characters compel's grammar gives a meaning.
const SYNTACTIC: &str = "()\",.+-=";

/// pyparsing's default whitespace, which most elements skip before matching.
fn is_pp_white(c: char) -> bool {
    matches!(c, ' ' | '\t' | '\n' | '\r')
}

/// Python's `string.whitespace`.
fn is_py_white(c: char) -> bool {
    matches!(c, ' ' | '\t' | '\n' | '\r' | '\x0b' | '\x0c')
}

/// `Ok(None)`: no match here (pyparsing backtracks); `Err`: compel raises.
type Res<T> = Result<Option<(usize, T)>, String>;

/// The alternatives of compel's repeated rules, in its order of trying them.
#[derive(Clone, Copy)]
enum Rule {
    Lora,
    Attention,
    Swap,
    Paren,
    Quoted,
    Word,
    FreeWord,
    Punctuation,
    White,
}

/// An option of `.blend(…)`: `key=value`, a number, or a flag.
enum Opt {
    Number(f64),
    Word(String),
    KeyValue,
}

/// A rule's result at each position, computed once: without it nested groups are re-parsed by
/// every rule that may start with one, exponentially in the depth (pyparsing's packrat cache).
type Memo = RefCell<HashMap<usize, Result<Option<(usize, Vec<Node>)>, String>>>;

struct Grammar<'a> {
    s: &'a [char],
    parens: Memo,
    quotes: Memo,
}

impl<'a> Grammar<'a> {
    fn new(s: &'a [char]) -> Self {
        Self {
            s,
            parens: Memo::default(),
            quotes: Memo::default(),
        }
    }

    fn memo(cache: &Memo, i: usize, rule: impl FnOnce() -> Res<Vec<Node>>) -> Res<Vec<Node>> {
        if let Some(r) = cache.borrow().get(&i) {
            return r.clone();
        }
        let r = rule();
        cache.borrow_mut().insert(i, r.clone());
        r
    }

    fn ws(&self, mut i: usize) -> usize {
        while i < self.s.len() && is_pp_white(self.s[i]) {
            i += 1;
        }
        i
    }

    fn at(&self, i: usize) -> Option<char> {
        self.s.get(i).copied()
    }

    /// `Literal(text)`, after skipping whitespace.
    fn lit(&self, i: usize, text: &str) -> Option<usize> {
        let mut j = self.ws(i);
        for c in text.chars() {
            if self.at(j) != Some(c) {
                return None;
            }
            j += 1;
        }
        Some(j)
    }

    fn is_syntactic(c: char) -> bool {
        SYNTACTIC.contains(c)
    }

    /// `non_syntax_word`: escaped syntax characters, a `+`/`-` followed by neither whitespace,
    /// syntax nor the end, and any other non-space character, with no space between.
    fn word(&self, i: usize) -> Option<(usize, Node)> {
        let start = self.ws(i);
        let mut j = start;
        loop {
            match self.at(j) {
                Some('\\') if self.at(j + 1).is_some_and(Self::is_syntactic) => j += 2,
                Some('+' | '-')
                    if self
                        .at(j + 1)
                        .is_some_and(|n| !is_pp_white(n) && !Self::is_syntactic(n)) =>
                {
                    j += 1
                }
                Some(c) if !is_py_white(c) && !Self::is_syntactic(c) => j += 1,
                _ => break,
            }
        }
        (j > start).then(|| {
            let text: String = self.s[start..j].iter().collect();
            (j, Node::Text(unescape(&text)))
        })
    }

    /// `free_word`: a run of non-whitespace characters, without skipping whitespace first.
    fn free_word(&self, i: usize) -> Option<(usize, Node)> {
        let mut j = i;
        while self.at(j).is_some_and(|c| !is_py_white(c)) {
            j += 1;
        }
        (j > i).then(|| (j, Node::Text(unescape(&self.text(i, j)))))
    }

    fn text(&self, a: usize, b: usize) -> String {
        self.s[a..b].iter().collect()
    }

    /// pyparsing's `QuotedString('"', esc_quote='\\"')`: the text between the quotes, with `\"`
    /// read as `"`. Its regex `"(?:\\"|[^"\n\r])*"` backtracks to the last `\"` when no plain
    /// closing quote follows.
    fn quoted_raw(&self, i: usize) -> Option<(usize, String)> {
        let open = self.ws(i);
        if self.at(open) != Some('"') {
            return None;
        }
        let mut j = open + 1;
        let mut last_escaped = None;
        let close = loop {
            match self.at(j) {
                Some('\\') if self.at(j + 1) == Some('"') => {
                    last_escaped = Some(j + 1);
                    j += 2;
                }
                Some('"') => break Some(j),
                Some('\n' | '\r') | None => break last_escaped,
                Some(_) => j += 1,
            }
        }?;
        Some((close + 1, self.text(open + 1, close).replace("\\\"", "\"")))
    }

    /// `quoted_fragment`: a quoted string whose text is parsed again as fragments.
    fn quoted(&self, i: usize) -> Res<Vec<Node>> {
        Self::memo(&self.quotes, i, || self.quoted_uncached(i))
    }

    fn quoted_uncached(&self, i: usize) -> Res<Vec<Node>> {
        self.quoted_as(i, |g| g.fragments(0, true))
    }

    /// `quoted_prompt` (in a blend's list): a quoted string parsed as a whole prompt.
    fn quoted_prompt(&self, i: usize) -> Res<Vec<Node>> {
        self.quoted_as(i, |g| g.prompt(0))
    }

    /// A quoted string whose text (`"` escaped again, as compel does) `inner` parses to its end.
    fn quoted_as(
        &self,
        i: usize,
        inner: impl Fn(&Grammar) -> Result<(usize, Vec<Node>), String>,
    ) -> Res<Vec<Node>> {
        let Some((j, content)) = self.quoted_raw(i) else {
            return Ok(None);
        };
        if content.trim().is_empty() {
            return Ok(Some((j, vec![Node::Text(String::new())])));
        }
        let chars: Vec<char> = content.replace('"', "\\\"").chars().collect();
        let g = Grammar::new(&chars);
        let (k, nodes) = inner(&g)?;
        Ok((g.ws(k) == chars.len()).then_some((j, nodes)))
    }

    /// `parenthesized_fragment`.
    fn paren(&self, i: usize) -> Res<Vec<Node>> {
        Self::memo(&self.parens, i, || self.paren_uncached(i))
    }

    fn paren_uncached(&self, i: usize) -> Res<Vec<Node>> {
        let Some(j) = self.lit(i, "(") else {
            return Ok(None);
        };
        let (k, nodes) = self.fragments(j, true)?;
        Ok(self.lit(k, ")").map(|e| (e, nodes)))
    }

    /// `fragment_including_commas_or_periods` (`commas`) or `fragment_excluding_commas`.
    fn fragments(&self, i: usize, commas: bool) -> Result<(usize, Vec<Node>), String> {
        use Rule::*;
        match commas {
            true => self.repeat(
                i,
                &[Lora, Attention, Swap, Paren, Quoted, Word, Punctuation],
            ),
            false => self.repeat(i, &[Lora, Attention, Swap, Paren, Quoted, Word]),
        }
    }

    /// pyparsing's `ZeroOrMore(MatchFirst(rules))`: the first rule that matches, again and
    /// again, until none does.
    fn repeat(&self, mut i: usize, rules: &[Rule]) -> Result<(usize, Vec<Node>), String> {
        let mut out = Vec::new();
        'next: loop {
            for rule in rules {
                if let Some((j, nodes)) = self.rule(*rule, i)? {
                    out.extend(nodes);
                    i = j;
                    continue 'next;
                }
            }
            return Ok((i, out));
        }
    }

    fn rule(&self, rule: Rule, i: usize) -> Res<Vec<Node>> {
        let one = |r: Option<(usize, Node)>| r.map(|(j, n)| (j, vec![n]));
        Ok(match rule {
            Rule::Lora => one(self.lora(i)?),
            Rule::Attention => one(self.attention(i)?),
            Rule::Swap => one(self.swap(i)?),
            Rule::Paren => self.paren(i)?,
            Rule::Quoted => self.quoted(i)?,
            Rule::Word => one(self.word(i)),
            Rule::FreeWord => one(self.free_word(i)),
            Rule::Punctuation => self
                .lit(i, ",")
                .or_else(|| self.lit(i, "."))
                .map(|j| (j, vec![Node::Text(self.text(j - 1, j))])),
            // Suppressed: matches the spaces and yields nothing.
            Rule::White => self
                .at(i)
                .is_some_and(is_pp_white)
                .then(|| (self.ws(i), Vec::new())),
        })
    }

    /// `potential_operator_target`: quoted, parenthesized, or a bare word.
    fn target(&self, i: usize) -> Res<Vec<Node>> {
        if let Some(r) = self.quoted(i)? {
            return Ok(Some(r));
        }
        if let Some(r) = self.paren(i)? {
            return Ok(Some(r));
        }
        Ok(self.word(i).map(|(j, n)| (j, vec![n])))
    }

    /// `number`: pyparsing's real (`[+-]?(\d+\.\d*|\.\d+)`), else an optionally negative integer.
    fn number(&self, i: usize) -> Option<(usize, f64)> {
        let start = self.ws(i);
        let digits = |mut j: usize| {
            while self.at(j).is_some_and(|c| c.is_ascii_digit()) {
                j += 1;
            }
            j
        };
        let mut j = start;
        if matches!(self.at(j), Some('+' | '-')) {
            j += 1;
        }
        let int_end = digits(j);
        let real_end = if int_end > j && self.at(int_end) == Some('.') {
            Some(digits(int_end + 1))
        } else if int_end == j && self.at(j) == Some('.') {
            let e = digits(j + 1);
            (e > j + 1).then_some(e)
        } else {
            None
        };
        let end = match real_end {
            Some(e) => e,
            None => {
                let mut k = start;
                if self.at(k) == Some('-') {
                    k += 1;
                }
                let e = digits(k);
                if e == k {
                    return None;
                }
                e
            }
        };
        self.text(start, end).parse::<f64>().ok().map(|v| (end, v))
    }

    /// `Word(c)`: a run of `c`, after skipping whitespace.
    fn run_of(&self, i: usize, c: char) -> Option<(usize, usize)> {
        let start = self.ws(i);
        let mut j = start;
        while self.at(j) == Some(c) {
            j += 1;
        }
        (j > start).then_some((j, j - start))
    }

    /// `attention_weight_operator`, or only its `+`/`-` runs.
    fn weight_op(&self, i: usize, numbers: bool) -> Option<(usize, f64)> {
        if let Some((j, n)) = self.run_of(i, '+') {
            return Some((j, 1.1f64.powf(n as f64)));
        }
        if let Some((j, n)) = self.run_of(i, '-') {
            return Some((j, 0.9f64.powf(n as f64)));
        }
        numbers.then(|| self.number(i)).flatten()
    }

    /// `attention`: `target.attend(w)`, `(group)w`/`"group"w` with no space before `w`, or
    /// `word+`/`word-`.
    fn attention(&self, i: usize) -> Res<Node> {
        if let Some((j, t)) = self.target(i)? {
            let w = self
                .lit(j, ".attend")
                .and_then(|k| self.lit(k, "("))
                .and_then(|k| self.weight_op(k, true))
                .and_then(|(k, w)| self.lit(k, ")").map(|e| (e, w)));
            if let Some((e, w)) = w {
                return Ok(Some((e, Node::Attention(w, t))));
            }
        }
        let group = match self.quoted(i)? {
            Some(r) => Some(r),
            None => self.paren(i)?,
        };
        if let Some((j, t)) = group {
            if !self.at(j).is_some_and(is_pp_white) {
                if let Some((e, w)) = self.weight_op(j, true) {
                    return Ok(Some((e, Node::Attention(w, t))));
                }
            }
        }
        if let Some((j, t)) = self.word(i) {
            if !self.at(j).is_some_and(is_pp_white) {
                if let Some((e, w)) = self.weight_op(j, false) {
                    return Ok(Some((e, Node::Attention(w, vec![t]))));
                }
            }
        }
        Ok(None)
    }

    /// `cross_attention_substitute`: `target.swap(replacement[, options])`.
    fn swap(&self, i: usize) -> Res<Node> {
        let Some((j, _)) = self.target(i)? else {
            return Ok(None);
        };
        let Some(k) = self.lit(j, ".swap").and_then(|k| self.lit(k, "(")) else {
            return Ok(None);
        };
        let (mut k, _) = self.fragments(k, false)?;
        if let Some(c) = self.lit(k, ",") {
            match self.options(c) {
                Some((e, _)) => k = e,
                None => return Ok(None),
            }
        }
        Ok(self.lit(k, ")").map(|e| (e, Node::Swap)))
    }

    /// `lora_weight`: `withLora(name[, weight])` or `useLora(…)`.
    fn lora(&self, i: usize) -> Res<Node> {
        let Some(j) = self
            .lit(i, "useLora")
            .or_else(|| self.lit(i, "withLora"))
            .and_then(|j| self.lit(j, "("))
        else {
            return Ok(None);
        };
        let Some(mut k) = self.keyword(j).map(|(k, _)| k) else {
            return Ok(None);
        };
        if let Some((e, _)) = self.lit(k, ",").and_then(|c| self.number(c)) {
            k = e;
        }
        Ok(self.lit(k, ")").map(|e| (e, Node::Lora)))
    }

    /// `keyword`: letters, digits, `_` and `-`.
    fn keyword(&self, i: usize) -> Option<(usize, String)> {
        let start = self.ws(i);
        let mut j = start;
        while self
            .at(j)
            .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
        {
            j += 1;
        }
        (j > start).then(|| (j, self.text(start, j)))
    }

    /// `options`: an optional comma-separated list of `key=value`, numbers and flags.
    fn options(&self, i: usize) -> Option<(usize, Vec<Opt>)> {
        let option = |i: usize| -> Option<(usize, Opt)> {
            if let Some((j, _)) = self.keyword(i) {
                if let Some(k) = self.lit(j, "=") {
                    if let Some((e, _)) = self.number(k) {
                        return Some((e, Opt::KeyValue));
                    }
                    if let Some((e, _)) = self.keyword(k) {
                        return Some((e, Opt::KeyValue));
                    }
                }
            }
            if let Some((j, v)) = self.number(i) {
                return Some((j, Opt::Number(v)));
            }
            self.keyword(i).map(|(j, w)| (j, Opt::Word(w)))
        };
        let mut out = Vec::new();
        let Some((mut i, first)) = option(i) else {
            return Some((i, out));
        };
        out.push(first);
        while let Some((j, o)) = self.lit(i, ",").and_then(option) {
            out.push(o);
            i = j;
        }
        Some((i, out))
    }

    /// `(target, …).blend(weights[, no_normalize])`, or with `op` `.and`/`.add`: the list.
    fn operator_list(&self, i: usize, ops: &[&str]) -> Res<(Vec<Vec<Node>>, Vec<Opt>)> {
        let Some(mut j) = self.lit(i, "(") else {
            return Ok(None);
        };
        let mut items = Vec::new();
        loop {
            let Some((k, nodes)) = self.list_item(j)? else {
                return Ok(None);
            };
            items.push(nodes);
            j = k;
            match self.lit(j, ",") {
                Some(c) if self.list_item(c)?.is_some() => j = c,
                _ => break,
            }
        }
        let Some(k) = self.lit(j, ")") else {
            return Ok(None);
        };
        let Some(k) = ops.iter().find_map(|op| self.lit(k, op)) else {
            return Ok(None);
        };
        let Some((k, opts)) = self.lit(k, "(").and_then(|k| self.options(k)) else {
            return Ok(None);
        };
        Ok(self.lit(k, ")").map(|e| (e, (items, opts))))
    }

    /// An entry of a blend's or a conjunction's list: a target, or a quoted whole prompt.
    fn list_item(&self, i: usize) -> Res<Vec<Node>> {
        match self.target(i)? {
            Some(r) => Ok(Some(r)),
            None => self.quoted_prompt(i),
        }
    }

    /// `explicit_conjunction`: matched only to refuse it.
    fn conjunction(&self, i: usize) -> Res<()> {
        Ok(self
            .operator_list(i, &[".and", ".add"])?
            .map(|(j, _)| (j, ())))
    }

    fn blend(&self, i: usize) -> Res<Node> {
        let Some((j, (items, opts))) = self.operator_list(i, &[".blend"])? else {
            return Ok(None);
        };
        let mut opts: Vec<Opt> = opts;
        let mut normalize = true;
        if matches!(opts.last(), Some(Opt::Word(w)) if w == "no_normalize") {
            normalize = false;
            opts.pop();
        }
        let mut weights = Vec::new();
        for o in opts {
            match o {
                Opt::Number(v) => weights.push(v),
                Opt::Word(w) => match w.parse::<f64>() {
                    Ok(v) => weights.push(v),
                    Err(_) => return Err(format!("`.blend()` weight `{w}` is not a number")),
                },
                Opt::KeyValue => return Err("`.blend()` takes numbers, not `key=value`".into()),
            }
        }
        Ok(Some((j, Node::Blend(items, weights, normalize))))
    }

    /// `prompt`: swaps, LoRA terms, attention, quoted and parenthesized groups, and any other run
    /// of non-space characters as it stands.
    fn prompt(&self, i: usize) -> Result<(usize, Vec<Node>), String> {
        use Rule::*;
        self.repeat(i, &[Swap, Lora, Attention, Quoted, Paren, FreeWord, White])
    }

    /// `implicit_conjunction`: LoRA terms, then a blend or a prompt, then LoRA terms, then the
    /// end.
    fn implicit_conjunction(&self) -> Res<Node> {
        if self.lora(0)?.is_some() {
            return Err(
                "compel's `withLora(…)`/`useLora(…)` is not supported in samples; give \
                        the LoRA with `--lora`"
                    .into(),
            );
        }
        let (j, node) = match self.blend(0)? {
            Some(r) => r,
            None => {
                let (j, nodes) = self.prompt(0)?;
                (j, Node::Group(nodes))
            }
        };
        if self.lora(j)?.is_some() {
            return Err(
                "compel's `withLora(…)`/`useLora(…)` is not supported in samples; give \
                        the LoRA with `--lora`"
                    .into(),
            );
        }
        Ok((self.ws(j) == self.s.len()).then_some((j, node)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Nested groups parse in time linear in the depth (the memo; without it each level costs
    /// about 4.5× the one inside, 1 s at depth 10), and a prompt past the bound on groups is
    /// refused rather than risking the stack.
    #[test]
    fn deep_nesting_is_fast_and_bounded() {
        let deep = format!("{}cat{}1.1 dog", "(".repeat(150), ")".repeat(150));
        let t = std::time::Instant::now();
        let p = parse(&deep).unwrap();
        assert!(t.elapsed().as_secs_f64() < 1.0, "{:?}", t.elapsed());
        assert_eq!(
            p,
            WeightedPrompt::Fragments(vec![
                Fragment {
                    text: "cat".into(),
                    weight: 1.1
                },
                Fragment {
                    text: "dog".into(),
                    weight: 1.0
                },
            ])
        );
        let too_deep = format!("{}cat{}", "(".repeat(201), ")".repeat(201));
        assert!(parse(&too_deep).unwrap_err().contains("at most 200"));
    }
}
