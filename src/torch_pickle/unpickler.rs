//! A pickle reader that builds data and runs nothing: the opcodes `torch.save` writes (protocol
//! 2, and the protocol 4/5 framing and memo ops) turn into a [`Value`] tree. A `GLOBAL` is only a
//! name, a `REDUCE` or `NEWOBJ` only records which name would have been called with which
//! arguments, a `BUILD` only records the state; nothing is imported, called or looked up. This
//! is the guarantee `torch.load(weights_only=True)` gives, without its allow-list: names are
//! interpreted later ([`super::archive`]) and only torch's tensor-rebuild functions mean anything.
//!
//! Hostile input ends in an error, never a panic or an unbounded allocation: every length is
//! checked against the bytes left, containers may nest at most [`MAX_DEPTH`] deep, and copies
//! out of the memo are charged to a node budget (a memo `GET` of a big object repeated in a
//! loop would otherwise grow without limit, the pickle "billion laughs").

use std::collections::HashMap;

/// Containers nested deeper than this are refused (a state dict nests 4–6 levels).
pub const MAX_DEPTH: u32 = 256;

/// A pickled value. Objects of any class are kept as an opaque [`Value::Object`].
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    None,
    Bool(bool),
    Int(i64),
    Float(f64),
    /// An integer wider than 64 bits: its little-endian two's-complement bytes.
    BigInt(Vec<u8>),
    Str(String),
    Bytes(Vec<u8>),
    Tuple(Vec<Value>),
    List(Vec<Value>),
    Dict(Vec<(Value, Value)>),
    /// `module.name`, unresolved.
    Global {
        module: String,
        name: String,
    },
    /// What `callable(*args)` would have built (`REDUCE`, `NEWOBJ`), with any items, elements and
    /// `BUILD` state later added to it.
    Object {
        callable: Box<Value>,
        args: Box<Value>,
        items: Vec<(Value, Value)>,
        elements: Vec<Value>,
        state: Option<Box<Value>>,
    },
    /// A persistent id (`BINPERSID`): torch's reference to a storage record.
    PersistentId(Box<Value>),
}

impl Value {
    /// The string, for a `Str`.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }

    /// The integer, for an `Int`.
    pub fn as_int(&self) -> Option<i64> {
        match self {
            Value::Int(i) => Some(*i),
            _ => None,
        }
    }

    /// The elements of a tuple or list.
    pub fn as_seq(&self) -> Option<&[Value]> {
        match self {
            Value::Tuple(v) | Value::List(v) => Some(v),
            _ => None,
        }
    }

    /// The entries of a mapping: a dict, or an object built with no arguments and then filled
    /// by `SETITEMS` (an `OrderedDict`, or a dict subclass such as Lightning's `AttributeDict`).
    pub fn as_mapping(&self) -> Option<&[(Value, Value)]> {
        match self {
            Value::Dict(items) => Some(items),
            Value::Object { args, items, .. }
                if args.as_seq().is_some_and(<[Value]>::is_empty) || !items.is_empty() =>
            {
                Some(items)
            }
            _ => None,
        }
    }

    /// The values `self` holds directly (a container's elements, a dict's keys and values, an
    /// object's callable, arguments, items, elements and state).
    pub fn children(&self) -> Vec<&Value> {
        fn pairs(ps: &[(Value, Value)]) -> Vec<&Value> {
            ps.iter().flat_map(|(k, v)| [k, v]).collect()
        }
        match self {
            Value::Tuple(vs) | Value::List(vs) => vs.iter().collect(),
            Value::Dict(ps) => pairs(ps),
            Value::Object {
                callable,
                args,
                items,
                elements,
                state,
            } => {
                let mut out = vec![callable.as_ref(), args.as_ref()];
                out.extend(pairs(items));
                out.extend(elements);
                out.extend(state.as_deref());
                out
            }
            Value::PersistentId(v) => vec![v.as_ref()],
            _ => Vec::new(),
        }
    }

    /// `(module, name)` of a `Global`.
    pub fn as_global(&self) -> Option<(&str, &str)> {
        match self {
            Value::Global { module, name } => Some((module, name)),
            _ => None,
        }
    }
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum PickleError {
    #[error("the pickle ends early (at byte {0})")]
    Truncated(usize),
    #[error("unsupported pickle opcode 0x{op:02x} at byte {at}")]
    Opcode { op: u8, at: usize },
    #[error("malformed pickle at byte {at}: {message}")]
    Malformed { at: usize, message: String },
    #[error("the pickle nests containers more than {MAX_DEPTH} deep (at byte {0})")]
    TooDeep(usize),
    #[error(
        "the pickle builds more than {0} values (or their text), more than a checkpoint holds"
    )]
    TooLarge(usize),
}

/// A stack slot: a value, how deep it nests, and the memo ids it was stored under.
struct Slot {
    value: Value,
    depth: u32,
    memo: Vec<u32>,
}

/// A memo entry. Python's memo holds a reference, so a `SETITEMS` after the `PUT` shows in a
/// later `GET`: while the object is on the stack the entry points at its slot (`Live`), and it
/// is copied (`Frozen`) only when the slot leaves the stack, once.
enum Memo {
    Live(usize),
    Frozen(Value, u32),
}

struct Machine<'a> {
    data: &'a [u8],
    pos: usize,
    stack: Vec<Slot>,
    marks: Vec<usize>,
    memo: HashMap<u32, Memo>,
    /// Units still allowed: one per value built or copied, one per 32 bytes of text.
    budget: usize,
    budget_total: usize,
}

/// Reads one pickle from `data` up to its `STOP`.
pub fn unpickle(data: &[u8]) -> Result<Value, PickleError> {
    unpickle_prefix(data).map(|(v, _)| v)
}

/// Reads the pickle at the start of `data`: its value and the offset just past its `STOP` (torch's
/// legacy format writes several pickles one after another, then the raw storages).
pub fn unpickle_prefix(data: &[u8]) -> Result<(Value, usize), PickleError> {
    // Every value built or copied is charged: 8 units per input byte is far above any state
    // dict (about one value per 10 bytes, each copied out of the memo once or twice), and the cap
    // (8 M values, under a GB) is far above an SD checkpoint with its EMA and optimizer states
    // (SD1.5's `.ckpt` is about 30 000) while bounding what a hostile pickle can allocate.
    let budget = data.len().saturating_mul(8).clamp(1 << 20, 1 << 23);
    let mut m = Machine {
        data,
        pos: 0,
        stack: Vec::new(),
        marks: Vec::new(),
        memo: HashMap::new(),
        budget,
        budget_total: budget,
    };
    loop {
        let at = m.pos;
        let op = m.byte()?;
        if op == b'.' {
            let floor = m.marks.last().copied().unwrap_or(0);
            return match m.stack.pop() {
                Some(top) if m.stack.len() >= floor => Ok((top.value, m.pos)),
                _ => Err(malformed(at, "STOP with an empty stack")),
            };
        }
        m.step(op, at)?;
    }
}

fn malformed(at: usize, message: impl Into<String>) -> PickleError {
    PickleError::Malformed {
        at,
        message: message.into(),
    }
}

impl<'a> Machine<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], PickleError> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.data.len())
            .ok_or(PickleError::Truncated(self.data.len()))?;
        let s = &self.data[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn byte(&mut self) -> Result<u8, PickleError> {
        Ok(self.take(1)?[0])
    }

    fn le<const N: usize>(&mut self) -> Result<[u8; N], PickleError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }

    fn len_u32(&mut self) -> Result<usize, PickleError> {
        Ok(u32::from_le_bytes(self.le()?) as usize)
    }

    fn len_u64(&mut self) -> Result<usize, PickleError> {
        let n = u64::from_le_bytes(self.le()?);
        usize::try_from(n).map_err(|_| PickleError::Truncated(self.data.len()))
    }

    /// A text line (protocol 0 arguments), without its newline.
    fn line(&mut self) -> Result<&'a str, PickleError> {
        let at = self.pos;
        let rest = &self.data[self.pos..];
        let n = rest
            .iter()
            .position(|&b| b == b'\n')
            .ok_or(PickleError::Truncated(self.data.len()))?;
        self.pos += n + 1;
        std::str::from_utf8(&rest[..n]).map_err(|_| malformed(at, "a text argument is not UTF-8"))
    }

    fn text(&mut self, n: usize, at: usize) -> Result<Value, PickleError> {
        let bytes = self.take(n)?;
        String::from_utf8(bytes.to_vec())
            .map(Value::Str)
            .map_err(|_| malformed(at, "a string is not UTF-8"))
    }

    /// Pushes a value whose parts are already charged (one unit for it, and its text).
    fn push(&mut self, value: Value, depth: u32, at: usize) -> Result<(), PickleError> {
        if depth > MAX_DEPTH {
            return Err(PickleError::TooDeep(at));
        }
        self.spend(1 + text_units(&value))?;
        self.stack.push(Slot {
            value,
            depth,
            memo: Vec::new(),
        });
        Ok(())
    }

    fn spend(&mut self, units: usize) -> Result<(), PickleError> {
        self.budget = self
            .budget
            .checked_sub(units)
            .ok_or(PickleError::TooLarge(self.budget_total))?;
        Ok(())
    }

    /// A slot leaving the stack (at index `index`): the memo entries that point at it keep a
    /// copy of its value.
    fn leave(&mut self, slot: &Slot, index: usize) -> Result<(), PickleError> {
        for &id in &slot.memo {
            if matches!(self.memo.get(&id), Some(Memo::Live(i)) if *i == index) {
                self.charge(&slot.value)?;
                self.memo
                    .insert(id, Memo::Frozen(slot.value.clone(), slot.depth));
            }
        }
        Ok(())
    }

    fn leaf(&mut self, value: Value, at: usize) -> Result<(), PickleError> {
        self.push(value, 0, at)
    }

    fn pop(&mut self, at: usize) -> Result<Slot, PickleError> {
        let floor = self.marks.last().copied().unwrap_or(0);
        if self.stack.len() <= floor {
            return Err(malformed(at, "pop from an empty stack"));
        }
        let slot = self
            .stack
            .pop()
            .ok_or_else(|| malformed(at, "empty stack"))?;
        self.leave(&slot, self.stack.len())?;
        Ok(slot)
    }

    fn top(&mut self, at: usize) -> Result<&mut Slot, PickleError> {
        let floor = self.marks.last().copied().unwrap_or(0);
        if self.stack.len() <= floor {
            return Err(malformed(at, "no value on the stack"));
        }
        self.stack
            .last_mut()
            .ok_or_else(|| malformed(at, "empty stack"))
    }

    /// The values pushed since the last `MARK`, and the mark removed.
    fn pop_mark(&mut self, at: usize) -> Result<Vec<Slot>, PickleError> {
        let mark = self
            .marks
            .pop()
            .ok_or_else(|| malformed(at, "no MARK to pop to"))?
            .min(self.stack.len());
        let slots = self.stack.split_off(mark);
        for (k, slot) in slots.iter().enumerate() {
            self.leave(slot, mark + k)?;
        }
        Ok(slots)
    }

    fn put(&mut self, id: u32, at: usize) -> Result<(), PickleError> {
        let index = self.stack.len().wrapping_sub(1);
        let slot = self.top(at)?;
        if !slot.memo.contains(&id) {
            slot.memo.push(id);
        }
        self.memo.insert(id, Memo::Live(index));
        Ok(())
    }

    fn get(&mut self, id: u32, at: usize) -> Result<(), PickleError> {
        let missing = || malformed(at, format!("memo slot {id} was never stored"));
        let (value, depth) = match self.memo.get(&id).ok_or_else(missing)? {
            Memo::Live(i) => {
                let slot = self.stack.get(*i).ok_or_else(missing)?;
                (slot.value.clone(), slot.depth)
            }
            Memo::Frozen(v, d) => (v.clone(), *d),
        };
        self.charge(&value)?;
        // Charged whole above; `push` charges its own unit again, a negligible overcount.
        self.push(value, depth, at)
    }

    /// Charges a copy of `v` to the node budget.
    fn charge(&mut self, v: &Value) -> Result<(), PickleError> {
        fn count(v: &Value, left: &mut usize) -> bool {
            let units = 1 + text_units(v);
            if *left < units {
                return false;
            }
            *left -= units;
            v.children().into_iter().all(|c| count(c, left))
        }
        if count(v, &mut self.budget) {
            Ok(())
        } else {
            Err(PickleError::TooLarge(self.budget_total))
        }
    }

    fn container(
        &mut self,
        slots: Vec<Slot>,
        make: fn(Vec<Value>) -> Value,
        at: usize,
    ) -> Result<(), PickleError> {
        let depth = 1 + slots.iter().map(|s| s.depth).max().unwrap_or(0);
        let value = make(slots.into_iter().map(|s| s.value).collect());
        self.push(value, depth, at)
    }

    fn pairs(slots: Vec<Slot>, at: usize) -> Result<(Vec<(Value, Value)>, u32), PickleError> {
        if !slots.len().is_multiple_of(2) {
            return Err(malformed(at, "an odd number of values for dict items"));
        }
        let depth = slots.iter().map(|s| s.depth).max().unwrap_or(0);
        let mut values = slots.into_iter().map(|s| s.value);
        let mut out = Vec::new();
        while let (Some(k), Some(v)) = (values.next(), values.next()) {
            out.push((k, v));
        }
        Ok((out, depth))
    }

    /// `SETITEM(S)`: adds `pairs` to the mapping on top of the stack.
    fn set_items(&mut self, slots: Vec<Slot>, at: usize) -> Result<(), PickleError> {
        let (pairs, depth) = Self::pairs(slots, at)?;
        let slot = self.top(at)?;
        match &mut slot.value {
            Value::Dict(items) | Value::Object { items, .. } => items.extend(pairs),
            other => return Err(malformed(at, format!("SETITEMS on a {}", kind(other)))),
        }
        slot.depth = slot.depth.max(depth + 1);
        if slot.depth > MAX_DEPTH {
            return Err(PickleError::TooDeep(at));
        }
        Ok(())
    }

    /// `APPEND(S)` and `ADDITEMS`: adds elements to the list (or set, or object) on top.
    fn append(&mut self, slots: Vec<Slot>, at: usize) -> Result<(), PickleError> {
        let depth = slots.iter().map(|s| s.depth).max().unwrap_or(0);
        let slot = self.top(at)?;
        match &mut slot.value {
            Value::List(items)
            | Value::Object {
                elements: items, ..
            } => items.extend(slots.into_iter().map(|s| s.value)),
            other => return Err(malformed(at, format!("APPENDS on a {}", kind(other)))),
        }
        slot.depth = slot.depth.max(depth + 1);
        if slot.depth > MAX_DEPTH {
            return Err(PickleError::TooDeep(at));
        }
        Ok(())
    }

    fn object(&mut self, callable: Slot, args: Slot, at: usize) -> Result<(), PickleError> {
        let depth = 1 + callable.depth.max(args.depth);
        let value = Value::Object {
            callable: Box::new(callable.value),
            args: Box::new(args.value),
            items: Vec::new(),
            elements: Vec::new(),
            state: None,
        };
        self.push(value, depth, at)
    }

    fn build(&mut self, state: Slot, at: usize) -> Result<(), PickleError> {
        let slot = self.top(at)?;
        // A non-object is wrapped in one, a level deeper.
        let wraps = !matches!(slot.value, Value::Object { .. });
        let depth = (slot.depth + u32::from(wraps)).max(state.depth + 1);
        match &mut slot.value {
            Value::Object { state: s, .. } => *s = Some(Box::new(state.value)),
            other => {
                // BUILD on a non-object (a global used as a class): wrap it.
                let callable = std::mem::replace(other, Value::None);
                *other = Value::Object {
                    callable: Box::new(callable),
                    args: Box::new(Value::Tuple(Vec::new())),
                    items: Vec::new(),
                    elements: Vec::new(),
                    state: Some(Box::new(state.value)),
                };
            }
        }
        slot.depth = depth;
        if depth > MAX_DEPTH {
            return Err(PickleError::TooDeep(at));
        }
        Ok(())
    }

    fn int(&mut self, bytes: &[u8], at: usize) -> Result<(), PickleError> {
        // LONG1/LONG4: little-endian two's complement. Wider than i64 (torch's legacy magic
        // number): kept as its bytes.
        if bytes.len() > 8 {
            return self.leaf(Value::BigInt(bytes.to_vec()), at);
        }
        let mut v: i64 = 0;
        for (i, &b) in bytes.iter().enumerate() {
            v |= (b as i64) << (8 * i);
        }
        if let Some(&last) = bytes.last() {
            if bytes.len() < 8 && last & 0x80 != 0 {
                v -= 1i64 << (8 * bytes.len());
            }
        }
        self.leaf(Value::Int(v), at)
    }

    /// A memo id written as text (protocol 0's `PUT`/`GET`).
    fn text_memo_id(&mut self, at: usize) -> Result<u32, PickleError> {
        let line = self.line()?;
        line.parse()
            .map_err(|_| malformed(at, format!("memo id `{line}`")))
    }

    fn text_int(&mut self, at: usize) -> Result<(), PickleError> {
        let line = self.line()?;
        let t = line.trim_end_matches('L');
        let v = match t {
            "00" => Value::Bool(false),
            "01" => Value::Bool(true),
            _ => Value::Int(
                t.parse()
                    .map_err(|_| malformed(at, format!("`{line}` is not an integer")))?,
            ),
        };
        self.leaf(v, at)
    }

    fn global(&mut self, module: String, name: String, at: usize) -> Result<(), PickleError> {
        self.leaf(Value::Global { module, name }, at)
    }

    fn step(&mut self, op: u8, at: usize) -> Result<(), PickleError> {
        match op {
            0x80 => {
                self.byte()?; // PROTO
            }
            0x95 => {
                self.le::<8>()?; // FRAME: a length hint
            }
            b'(' => self.marks.push(self.stack.len()),
            b'0' => {
                self.pop(at)?;
            }
            b'1' => {
                self.pop_mark(at)?;
            }
            b'2' => {
                let s = self.top(at)?;
                let (v, d) = (s.value.clone(), s.depth);
                self.charge(&v)?;
                self.push(v, d, at)?;
            }
            b'N' => self.leaf(Value::None, at)?,
            0x88 => self.leaf(Value::Bool(true), at)?,
            0x89 => self.leaf(Value::Bool(false), at)?,
            b'J' => {
                let v = i32::from_le_bytes(self.le()?);
                self.leaf(Value::Int(v as i64), at)?
            }
            b'K' => {
                let v = self.byte()?;
                self.leaf(Value::Int(v as i64), at)?
            }
            b'M' => {
                let v = u16::from_le_bytes(self.le()?);
                self.leaf(Value::Int(v as i64), at)?
            }
            0x8a => {
                let n = self.byte()? as usize;
                let bytes = self.take(n)?;
                self.int(bytes, at)?
            }
            0x8b => {
                let n = self.len_u32()?;
                let bytes = self.take(n)?;
                self.int(bytes, at)?
            }
            b'I' | b'L' => self.text_int(at)?,
            b'G' => {
                let v = f64::from_be_bytes(self.le()?);
                self.leaf(Value::Float(v), at)?
            }
            b'F' => {
                let line = self.line()?;
                let v = line
                    .parse()
                    .map_err(|_| malformed(at, format!("`{line}` is not a float")))?;
                self.leaf(Value::Float(v), at)?
            }
            b'X' | b'T' => {
                let n = self.len_u32()?;
                let v = self.text(n, at)?;
                self.leaf(v, at)?
            }
            0x8c | b'U' => {
                let n = self.byte()? as usize;
                let v = self.text(n, at)?;
                self.leaf(v, at)?
            }
            0x8d => {
                let n = self.len_u64()?;
                let v = self.text(n, at)?;
                self.leaf(v, at)?
            }
            b'B' => {
                let n = self.len_u32()?;
                let v = self.take(n)?.to_vec();
                self.leaf(Value::Bytes(v), at)?
            }
            b'C' => {
                let n = self.byte()? as usize;
                let v = self.take(n)?.to_vec();
                self.leaf(Value::Bytes(v), at)?
            }
            0x8e | 0x96 => {
                let n = self.len_u64()?;
                let v = self.take(n)?.to_vec();
                self.leaf(Value::Bytes(v), at)?
            }
            b')' => self.leaf(Value::Tuple(Vec::new()), at)?,
            b't' => {
                let slots = self.pop_mark(at)?;
                self.container(slots, Value::Tuple, at)?
            }
            0x85..=0x87 => {
                let n = (op - 0x84) as usize;
                let mut slots = Vec::with_capacity(n);
                for _ in 0..n {
                    slots.push(self.pop(at)?);
                }
                slots.reverse();
                self.container(slots, Value::Tuple, at)?
            }
            b']' | 0x8f => self.leaf(Value::List(Vec::new()), at)?,
            b'l' | 0x91 => {
                let slots = self.pop_mark(at)?;
                self.container(slots, Value::List, at)?
            }
            b'a' => {
                let v = self.pop(at)?;
                self.append(vec![v], at)?
            }
            b'e' | 0x90 => {
                let slots = self.pop_mark(at)?;
                self.append(slots, at)?
            }
            b'}' => self.leaf(Value::Dict(Vec::new()), at)?,
            b'd' => {
                let slots = self.pop_mark(at)?;
                let (pairs, depth) = Self::pairs(slots, at)?;
                self.push(Value::Dict(pairs), depth + 1, at)?
            }
            b's' => {
                let v = self.pop(at)?;
                let k = self.pop(at)?;
                self.set_items(vec![k, v], at)?
            }
            b'u' => {
                let slots = self.pop_mark(at)?;
                self.set_items(slots, at)?
            }
            b'c' => {
                let module = self.line()?.to_string();
                let name = self.line()?.to_string();
                self.global(module, name, at)?
            }
            0x93 => {
                let name = self.pop(at)?.value;
                let module = self.pop(at)?.value;
                match (module, name) {
                    (Value::Str(module), Value::Str(name)) => self.global(module, name, at)?,
                    _ => return Err(malformed(at, "STACK_GLOBAL without two strings")),
                }
            }
            b'R' | 0x81 => {
                let args = self.pop(at)?;
                let callable = self.pop(at)?;
                self.object(callable, args, at)?
            }
            0x92 => {
                let _kwargs = self.pop(at)?;
                let args = self.pop(at)?;
                let callable = self.pop(at)?;
                self.object(callable, args, at)?
            }
            b'b' => {
                let state = self.pop(at)?;
                self.build(state, at)?
            }
            b'Q' => {
                let pid = self.pop(at)?;
                self.push(Value::PersistentId(Box::new(pid.value)), pid.depth + 1, at)?
            }
            b'P' => {
                let line = self.line()?.to_string();
                self.push(Value::PersistentId(Box::new(Value::Str(line))), 1, at)?
            }
            b'q' => {
                let id = self.byte()? as u32;
                self.put(id, at)?
            }
            b'r' => {
                let id = u32::from_le_bytes(self.le()?);
                self.put(id, at)?
            }
            0x94 => {
                let id = self.memo.len() as u32;
                self.put(id, at)?
            }
            b'p' => {
                let id = self.text_memo_id(at)?;
                self.put(id, at)?
            }
            b'h' => {
                let id = self.byte()? as u32;
                self.get(id, at)?
            }
            b'j' => {
                let id = u32::from_le_bytes(self.le()?);
                self.get(id, at)?
            }
            b'g' => {
                let id = self.text_memo_id(at)?;
                self.get(id, at)?
            }
            _ => return Err(PickleError::Opcode { op, at }),
        }
        Ok(())
    }
}

/// The units a value's own text costs (32 bytes a unit).
fn text_units(v: &Value) -> usize {
    match v {
        Value::Str(s) => s.len() / 32,
        Value::Bytes(b) | Value::BigInt(b) => b.len() / 32,
        _ => 0,
    }
}

/// A short name for what a value is, for errors.
pub fn kind(v: &Value) -> &'static str {
    match v {
        Value::None => "None",
        Value::Bool(_) => "bool",
        Value::Int(_) | Value::BigInt(_) => "int",
        Value::Float(_) => "float",
        Value::Str(_) => "str",
        Value::Bytes(_) => "bytes",
        Value::Tuple(_) => "tuple",
        Value::List(_) => "list",
        Value::Dict(_) => "dict",
        Value::Global { .. } => "global name",
        Value::Object { .. } => "object",
        Value::PersistentId(_) => "persistent id",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `pickle.dumps(obj, protocol=P).hex()` (Python 3.11) of
    /// `shared = [1, 2]; obj = {"a": (1, -1, 300, -70000, 2**40, -(2**63)), "s": "héllo",
    /// "b": b"\x00\xff", "f": 1.5, "n": None, "t": True, "x": False, "l": shared, "m": shared,
    /// "o": collections.OrderedDict([("k", 3)]), "e": (), "big": "y" * 300}`.
    const PROTO2: &str = concat!(
        "80027d7100285801000000617101284b014affffffff4d2c014a90eefeff8a060000000000018a0800000000",
        "000000807471025801000000737103580600000068c3a96c6c6f71045801000000627105635f636f6465637",
        "30a656e636f64650a7106580300000000c3bf710758060000006c6174696e31710886710952710a58010000",
        "0066710b473ff800000000000058010000006e710c4e580100000074710d88580100000078710e895801000",
        "0006c710f5d7110284b014b026558010000006d7111681058010000006f711263636f6c6c656374696f6e73",
        "0a4f726465726564446963740a71132952711458010000006b71154b037358010000006571162958030000",
        "006269677117582c010000",
    );
    const PROTO5_HEAD: &str = concat!(
        "800595da010000000000007d94288c016194284b014affffffff4d2c014a90eefeff8a06000000000001",
        "8a08000000000000008074948c0173948c0668c3a96c6c6f948c016294430200ff948c016694473ff8000",
        "0000000008c016e944e8c017494888c017894898c016c945d94284b014b02658c016d94680c8c016f948c",
        "0b636f6c6c656374696f6e73948c0b4f726465726564446963749493942952948c016b944b03738c0165",
        "94298c0362696794582c010000",
    );

    fn bytes(head: &str, tail: &str) -> Vec<u8> {
        let hex = |s: &str| -> Vec<u8> {
            (0..s.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
                .collect()
        };
        let mut b = hex(head);
        b.extend(std::iter::repeat_n(b'y', 300));
        b.extend(hex(tail));
        b
    }

    fn proto2() -> Vec<u8> {
        bytes(PROTO2, "7118752e")
    }

    fn proto5() -> Vec<u8> {
        bytes(PROTO5_HEAD, "94752e")
    }

    fn get<'a>(v: &'a Value, key: &str) -> &'a Value {
        let map = v.as_mapping().expect("a dict");
        &map.iter()
            .find(|(k, _)| k.as_str() == Some(key))
            .expect(key)
            .1
    }

    fn check_common(v: &Value) {
        let ints: Vec<i64> = get(v, "a")
            .as_seq()
            .unwrap()
            .iter()
            .map(|i| i.as_int().unwrap())
            .collect();
        assert_eq!(ints, [1, -1, 300, -70000, 1 << 40, i64::MIN]);
        assert_eq!(get(v, "s").as_str(), Some("héllo"));
        assert_eq!(get(v, "f"), &Value::Float(1.5));
        assert_eq!(get(v, "n"), &Value::None);
        assert_eq!(get(v, "t"), &Value::Bool(true));
        assert_eq!(get(v, "x"), &Value::Bool(false));
        // The memo: `m` is a GET of the list `l`, stored before APPENDS filled it.
        let list = Value::List(vec![Value::Int(1), Value::Int(2)]);
        assert_eq!(get(v, "l"), &list);
        assert_eq!(get(v, "m"), &list);
        let o = get(v, "o");
        assert_eq!(
            o.as_mapping().unwrap(),
            &[(Value::Str("k".into()), Value::Int(3))]
        );
        let Value::Object { callable, .. } = o else {
            panic!("{o:?}")
        };
        assert_eq!(callable.as_global(), Some(("collections", "OrderedDict")));
        assert_eq!(get(v, "e"), &Value::Tuple(vec![]));
        assert_eq!(get(v, "big").as_str().map(str::len), Some(300));
    }

    #[test]
    fn protocol_2_and_5_read_as_python_wrote_them() {
        let v2 = unpickle(&proto2()).unwrap();
        check_common(&v2);
        // Protocol 2 has no bytes opcode: `_codecs.encode(str, "latin1")`, kept as an object.
        let Value::Object { callable, .. } = get(&v2, "b") else {
            panic!()
        };
        assert_eq!(callable.as_global(), Some(("_codecs", "encode")));
        let v5 = unpickle(&proto5()).unwrap();
        check_common(&v5);
        assert_eq!(get(&v5, "b"), &Value::Bytes(vec![0, 0xff]));
    }

    #[test]
    fn truncated_or_corrupted_pickles_fail_without_panicking() {
        for data in [proto2(), proto5()] {
            for n in 0..data.len() {
                assert!(unpickle(&data[..n]).is_err(), "prefix {n} read");
            }
            for i in 0..data.len() {
                for flip in [0x01u8, 0x80, 0xff] {
                    let mut d = data.clone();
                    d[i] ^= flip;
                    let _ = unpickle(&d);
                }
            }
        }
    }

    #[test]
    fn a_memo_bomb_is_refused() {
        // [] PUT 0, then 30 × (GET 0, GET 0, TUPLE2, PUT 0): 2^30 values if copied out.
        let mut d = vec![0x80, 2, b']', b'q', 0];
        for _ in 0..30 {
            d.extend([
                b'h', 0, b'h', 0, 0x86, b'0', b'h', 0, b'h', 0, 0x86, b'q', 0,
            ]);
        }
        d.push(b'.');
        assert!(
            matches!(unpickle(&d), Err(PickleError::TooLarge(_))),
            "{:?}",
            unpickle(&d)
        );
    }

    #[test]
    fn copies_of_a_long_string_are_charged_by_length() {
        // A 100 kB string stored once, then fetched 50 000 times: 5 GB if each copy were free.
        let mut d = vec![0x80, 2, b'X'];
        d.extend(100_000u32.to_le_bytes());
        d.extend(std::iter::repeat_n(b'a', 100_000));
        d.extend([b'q', 0, b'(']);
        for _ in 0..50_000 {
            d.extend([b'h', 0]);
        }
        d.extend([b'l', b'.']);
        assert!(matches!(unpickle(&d), Err(PickleError::TooLarge(_))));
    }

    #[test]
    fn a_dict_stored_then_filled_is_fetched_filled_without_copies_per_batch() {
        // {} PUT 0, then 3 000 SETITEM batches, then GET 0: the GET sees every item, and the
        // batches cost no copy of the dict (quadratic before: a copy per batch).
        let mut d = vec![0x80, 2, b'(', b'}', b'q', 0];
        for i in 0..3_000u32 {
            d.push(b'J');
            d.extend(i.to_le_bytes());
            d.extend([b'N', b's']);
        }
        d.extend([b'h', 0, b't', b'.']);
        let v = unpickle(&d).unwrap();
        let Value::Tuple(parts) = v else { panic!() };
        assert_eq!(parts[0].as_mapping().map(<[_]>::len), Some(3_000));
        assert_eq!(parts[0], parts[1]);
    }

    #[test]
    fn nesting_past_the_limit_is_refused() {
        let mut d = vec![0x80, 2, b')'];
        d.extend(std::iter::repeat_n(0x85, MAX_DEPTH as usize + 1));
        d.push(b'.');
        assert!(matches!(unpickle(&d), Err(PickleError::TooDeep(_))));
        let mut ok = vec![0x80, 2, b')'];
        ok.extend(std::iter::repeat_n(0x85, MAX_DEPTH as usize - 1));
        ok.push(b'.');
        assert!(unpickle(&ok).is_ok());
    }

    #[test]
    fn globals_and_reduces_are_recorded_never_called() {
        // cos\nsystem\n (S'touch x' tR. : what `os.system("touch x")` pickles to.
        let d = b"cos\nsystem\n(X\x07\x00\x00\x00touch xtR.";
        let v = unpickle(d).unwrap();
        let Value::Object { callable, args, .. } = v else {
            panic!()
        };
        assert_eq!(callable.as_global(), Some(("os", "system")));
        assert_eq!(*args, Value::Tuple(vec![Value::Str("touch x".into())]));
    }
}
