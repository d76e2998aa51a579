//! The pre-scan of a JSON payload: one pass over its bytes, before any
//! decoder sees it, that bounds the work a record can cause and catches the
//! values a decoder would convert silently.
//!
//! It enforces the size and nesting limits ([`Limits`]), so no decoder ever
//! recurses deeper than `max_depth` (arrow-json formats an error by
//! recursing over the offending value: a value nested 100000 deep
//! overflowed the stack and aborted the process). With [`Columns`] it also
//! reads the literal of each field of an object that the schema declares,
//! inside structs, lists and maps too ([`Shape`]), and checks it fits its
//! column exactly: an integer column gets an integer in range (a
//! fraction of zeros, `1.0` or `1.5e1`, is exact), a float column a finite
//! number, a number column no string, a timestamp or date column no more
//! precision than it keeps. Everything else (whether the bytes are JSON at
//! all, types the scan does not check, values the schema does not declare)
//! is left to the decoder, which reports it. The scan never allocates on the common path;
//! it reads the objects and arrays the schema declares by their grammar and walks strings and digit
//! runs eight bytes at a time (a fraction of what arrow-json takes to decode
//! the same payload; `docs/performance.md`). With no
//! columns to check it only counts brackets, unless there are too many.

use std::sync::LazyLock;

use crate::bad_record::{BadReason, BadRecord};

/// How large and how deep one record may be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Limits {
    /// Payload bytes at most.
    pub(crate) max_bytes: usize,
    /// Open arrays and objects at most (`{"a":1}` is 1 deep).
    pub(crate) max_depth: usize,
}

impl Limits {
    /// Checks the size (only).
    pub(crate) fn check_size(&self, payload: &[u8]) -> Result<(), BadRecord> {
        if payload.len() > self.max_bytes {
            return Err(BadRecord::new(
                BadReason::TooLarge,
                format!(
                    "{} bytes, more than max_record_bytes ({})",
                    payload.len(),
                    self.max_bytes
                ),
            ));
        }
        Ok(())
    }
}

/// What a column takes, as far as the scan checks it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// An integer in `min..=max`, decoded by arrow-json's integer parser
    /// (or through an `f64` when the literal has a fraction or exponent).
    /// Every plain integer of up to `digits` digits (`neg_digits` when
    /// negative) is in range: those need no arithmetic.
    Integer {
        min: i128,
        max: i128,
        digits: u8,
        neg_digits: u8,
    },
    /// A timestamp: an integer (i64) or a string with at most `digits`
    /// fractional-second digits that are not zero.
    Timestamp { digits: u8 },
    /// A date: an integer (i32 days) or a date string without a time.
    Date,
    /// A 32-bit float: any finite number.
    Float32,
    /// A 64-bit float: any finite number.
    Float64,
}

impl Kind {
    /// An integer column of this range.
    pub(crate) const fn integer(min: i128, max: i128) -> Self {
        /// Digits of the largest all-nines number up to `limit`.
        const fn fits(limit: i128) -> u8 {
            let mut d = 0u8;
            let mut all_nines: i128 = 9;
            while d < 38 && all_nines <= limit {
                d += 1;
                all_nines = all_nines * 10 + 9;
            }
            d
        }
        Kind::Integer {
            min,
            max,
            digits: fits(max),
            neg_digits: fits(-min),
        }
    }

    fn name(self) -> &'static str {
        match self {
            Kind::Integer { .. } => "an integer",
            Kind::Timestamp { .. } => "a timestamp",
            Kind::Date => "a date",
            Kind::Float32 | Kind::Float64 => "a float",
        }
    }
}

/// Lossy conversions allowed (by default none is).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Allow {
    /// A number with a fraction into an integer, timestamp or date column
    /// (truncated toward zero).
    pub(crate) fraction_to_integer: bool,
    /// A string holding a number into a number column (parsed).
    pub(crate) string_to_number: bool,
    /// A timestamp string more precise than its column (the extra digits
    /// dropped), a date-time into a date column (the time dropped).
    pub(crate) truncate_time: bool,
}

/// What the scan checks of a value: a literal of a kind, or the values
/// inside an object or array.
#[derive(Debug, Clone)]
pub(crate) enum Shape {
    /// A literal that must fit this kind exactly.
    Leaf(Kind),
    /// An object (a struct): its fields of these names.
    Object(Columns),
    /// An array (a list): each element.
    List(Box<Shape>),
    /// An object (a map): each value, whatever its key.
    Map(Box<Shape>),
}

impl From<Kind> for Shape {
    fn from(kind: Kind) -> Self {
        Shape::Leaf(kind)
    }
}

/// The checked fields of an object: names and shapes (the top-level
/// columns of a schema, or a struct's fields).
#[derive(Debug, Clone)]
pub(crate) struct Columns {
    names: Vec<Box<[u8]>>,
    shapes: Vec<Shape>,
    /// By [`slot`] of a name: 0 when no column's name has that slot, the
    /// index + 1 of the one column that has it, or [`Columns::SHARED`]
    /// (compare them all).
    slots: Box<[u16; 256]>,
    allow: Allow,
}

impl Default for Columns {
    fn default() -> Self {
        Columns::new::<Shape>([], Allow::default())
    }
}

/// A cheap hash of a name: its length, first and last byte.
fn slot(key: &[u8]) -> usize {
    let first = key.first().copied().unwrap_or(0);
    let last = key.last().copied().unwrap_or(0);
    (key.len().wrapping_mul(31) ^ usize::from(first).wrapping_mul(7) ^ usize::from(last)) & 255
}

impl Columns {
    const SHARED: u16 = u16::MAX;

    pub(crate) fn new<S: Into<Shape>>(
        columns: impl IntoIterator<Item = (String, S)>,
        allow: Allow,
    ) -> Self {
        let mut c = Columns {
            names: Vec::new(),
            shapes: Vec::new(),
            slots: Box::new([0; 256]),
            allow,
        };
        for (name, shape) in columns {
            let s = &mut c.slots[slot(name.as_bytes())];
            *s = match u16::try_from(c.names.len() + 1) {
                Ok(i) if *s == 0 && i != Self::SHARED => i,
                _ => Self::SHARED,
            };
            c.names.push(name.into_bytes().into_boxed_slice());
            c.shapes.push(shape.into());
        }
        c
    }

    /// Whether there is nothing to check.
    pub(crate) fn is_empty(&self) -> bool {
        self.names.is_empty()
    }

    /// The index of the column named `key`.
    fn index_of(&self, key: &[u8], escaped: bool) -> Option<usize> {
        if escaped {
            // Rare: compare the unescaped key. Not valid JSON: the decoder
            // says so.
            let quoted = key_with_quotes(key);
            let key: String = serde_json::from_slice(&quoted).ok()?;
            return self.index_of(key.as_bytes(), false);
        }
        match self.slots[slot(key)] {
            0 => None,
            Self::SHARED => self.names.iter().position(|n| **n == *key),
            i => {
                let i = usize::from(i - 1);
                (*self.names[i] == *key).then_some(i)
            }
        }
    }
}

fn key_with_quotes(key: &[u8]) -> Vec<u8> {
    let mut quoted = Vec::with_capacity(key.len() + 2);
    quoted.push(b'"');
    quoted.extend_from_slice(key);
    quoted.push(b'"');
    quoted
}

fn too_deep(limits: &Limits, at: usize) -> BadRecord {
    BadRecord::new(
        BadReason::TooDeep,
        format!(
            "nested more than max_nesting_depth ({}) deep at byte {at}",
            limits.max_depth
        ),
    )
}

/// Where the string starting after the opening quote at `start` ends (the
/// index of its closing quote, or `bytes.len()` when it does not end), and
/// whether it has escapes.
fn string_end(bytes: &[u8], start: usize) -> (usize, bool) {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGH: u64 = 0x8080_8080_8080_8080;
    const QUOTES: u64 = ONES * b'"' as u64;
    const BACKSLASHES: u64 = ONES * b'\\' as u64;
    let mut i = start;
    let mut escaped = false;
    loop {
        // Eight bytes at a time: the lowest byte that is a quote or a
        // backslash (the has-zero-byte trick is exact for the lowest one).
        // Fewer instructions than memchr2 on Nexmark bids, whose strings
        // are short.
        while let Some(chunk) = bytes.get(i..i + 8) {
            let w = u64::from_le_bytes(chunk.try_into().expect("a chunk of 8 bytes"));
            let q = w ^ QUOTES;
            let b = w ^ BACKSLASHES;
            let found = (q.wrapping_sub(ONES) & !q | b.wrapping_sub(ONES) & !b) & HIGH;
            if found != 0 {
                i += (found.trailing_zeros() / 8) as usize;
                break;
            }
            i += 8;
        }
        while i < bytes.len() && !matches!(bytes[i], b'"' | b'\\') {
            i += 1;
        }
        match bytes.get(i) {
            Some(b'"') => return (i, escaped),
            Some(_) => {
                escaped = true;
                i += 2;
            }
            None => return (bytes.len(), escaped),
        }
    }
}

/// Where the run of ASCII digits starting at `start` ends.
fn digits_end(bytes: &[u8], start: usize) -> usize {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGH_NIBBLES: u64 = 0xF0 * ONES;
    const ZEROS: u64 = 0x30 * ONES;
    let mut i = start;
    // Eight bytes at a time: a byte is a digit when it and it plus 6 are
    // both 0x3_ (a carry out of a byte that is not a digit can only spoil
    // the bytes above it, so the lowest non-digit is exact).
    while let Some(chunk) = bytes.get(i..i + 8) {
        let w = u64::from_le_bytes(chunk.try_into().expect("a chunk of 8 bytes"));
        let other = (w & HIGH_NIBBLES ^ ZEROS) | (w.wrapping_add(6 * ONES) & HIGH_NIBBLES ^ ZEROS);
        if other != 0 {
            return i + (other.trailing_zeros() / 8) as usize;
        }
        i += 8;
    }
    while i < bytes.len() && bytes[i].is_ascii_digit() {
        i += 1;
    }
    i
}

/// Checks the size and nesting depth of `payload` only (for decoders that
/// check types themselves, such as serde).
pub(crate) fn check_structure(payload: &[u8], limits: &Limits) -> Result<(), BadRecord> {
    static NO_COLUMNS: LazyLock<Columns> = LazyLock::new(Columns::default);
    scan(payload, limits, &NO_COLUMNS)
}

/// Checks the size and nesting depth of `payload`, and the value of each
/// top-level field that is one of `columns`.
///
/// A top-level object is read by its grammar (key, colon, value, comma), so
/// each field costs a few predictable branches; nested values, and whatever
/// does not follow the grammar (the decoder reports it), are walked for
/// depth only.
pub(crate) fn scan(payload: &[u8], limits: &Limits, columns: &Columns) -> Result<(), BadRecord> {
    limits.check_size(payload)?;
    let b = payload;
    if columns.names.is_empty() {
        if memchr::memchr2_iter(b'{', b'[', b)
            .take(limits.max_depth + 1)
            .count()
            <= limits.max_depth
        {
            // No more brackets than levels allowed (in strings or not): no
            // need to walk the structure.
            return Ok(());
        }
        return walk(b, 0, 0, false, limits).map(drop);
    }
    let i = skip_whitespace(b, 0);
    if b.get(i) != Some(&b'{') || limits.max_depth == 0 {
        return walk(b, i, 0, false, limits).map(drop);
    }
    let scan = Scan {
        b,
        limits,
        allow: &columns.allow,
    };
    // Whatever follows the object, or what broke the grammar and after.
    let (i, depth) = match scan.object(i + 1, 1, Fields::Named(columns), None)? {
        Step::At(i) => (i, 0),
        Step::Broke(i, depth) => (i, depth),
    };
    walk(b, i, depth, false, limits).map(drop)
}

/// Where reading a value left off.
enum Step {
    /// Just after the value.
    At(usize),
    /// At the byte that broke the grammar, at this nesting depth: the
    /// rest is only walked for depth (the decoder reports the rest).
    Broke(usize, usize),
}

/// The fields an object's keys are looked up in.
#[derive(Clone, Copy)]
enum Fields<'a> {
    /// A struct's: by name; other keys are not checked.
    Named(&'a Columns),
    /// A map's: every value has this shape.
    Every(&'a Shape),
}

/// The path to a value, for the error: `buyer.address.zip`, `items[].qty`.
struct Path<'a> {
    up: Option<&'a Path<'a>>,
    /// A key (its raw bytes), or an array element.
    key: Option<&'a [u8]>,
}

impl Path<'_> {
    fn shown(&self) -> String {
        let up = self.up.map(Path::shown).unwrap_or_default();
        match self.key {
            Some(k) if up.is_empty() => String::from_utf8_lossy(k).into_owned(),
            Some(k) => format!("{up}.{}", String::from_utf8_lossy(k)),
            None => format!("{up}[]"),
        }
    }
}

struct Scan<'a> {
    b: &'a [u8],
    limits: &'a Limits,
    allow: &'a Allow,
}

impl Scan<'_> {
    /// The object whose `{` is just before `i`, its members at `depth`.
    fn object(
        &self,
        mut i: usize,
        depth: usize,
        fields: Fields<'_>,
        path: Option<&Path<'_>>,
    ) -> Result<Step, BadRecord> {
        let b = self.b;
        loop {
            i = skip_whitespace(b, i);
            match b.get(i) {
                Some(b'}') => return Ok(Step::At(i + 1)),
                Some(b'"') => {}
                _ => return Ok(Step::Broke(i, depth)),
            }
            let (end, escaped) = string_end(b, i + 1);
            let key = &b[i + 1..end];
            let shape = match fields {
                Fields::Named(columns) => {
                    columns.index_of(key, escaped).map(|c| &columns.shapes[c])
                }
                Fields::Every(shape) => Some(shape),
            };
            i = skip_whitespace(b, end + 1);
            if b.get(i) != Some(&b':') {
                return Ok(Step::Broke(i, depth));
            }
            i = skip_whitespace(b, i + 1);
            let here = Path {
                up: path,
                key: Some(key),
            };
            match self.value(i, depth, shape, &here)? {
                Step::At(next) => i = skip_whitespace(b, next),
                broke => return Ok(broke),
            }
            match b.get(i) {
                Some(b',') => i += 1,
                Some(b'}') => return Ok(Step::At(i + 1)),
                _ => return Ok(Step::Broke(i, depth)),
            }
        }
    }

    /// The array whose `[` is just before `i`, its elements at `depth`.
    fn array(
        &self,
        mut i: usize,
        depth: usize,
        shape: &Shape,
        path: &Path<'_>,
    ) -> Result<Step, BadRecord> {
        let b = self.b;
        let here = Path {
            up: Some(path),
            key: None,
        };
        loop {
            i = skip_whitespace(b, i);
            if b.get(i) == Some(&b']') {
                return Ok(Step::At(i + 1));
            }
            match self.value(i, depth, Some(shape), &here)? {
                Step::At(next) => i = skip_whitespace(b, next),
                broke => return Ok(broke),
            }
            match b.get(i) {
                Some(b',') => i += 1,
                Some(b']') => return Ok(Step::At(i + 1)),
                _ => return Ok(Step::Broke(i, depth)),
            }
        }
    }

    /// The value at `i`, a member or element at `depth`, checked against
    /// `shape` (nothing to check: `None`).
    fn value(
        &self,
        mut i: usize,
        depth: usize,
        shape: Option<&Shape>,
        path: &Path<'_>,
    ) -> Result<Step, BadRecord> {
        let b = self.b;
        let leaf = match shape {
            Some(Shape::Leaf(kind)) => Some(*kind),
            _ => None,
        };
        let named = |bad: BadRecord| with_column(bad, &path.shown());
        match b.get(i) {
            Some(b'"') => {
                let (end, escaped) = string_end(b, i + 1);
                if let Some(kind) = leaf {
                    check_string(kind, &b[i + 1..end], escaped, self.allow).map_err(named)?;
                }
                Ok(Step::At(end + 1))
            }
            Some(b'-' | b'0'..=b'9') => {
                let start = i;
                i = digits_end(b, i + 1);
                // Only digits after an optional minus sign.
                let plain = !matches!(b.get(i), Some(b'-' | b'+' | b'.' | b'e' | b'E'));
                while i < b.len() && matches!(b[i], b'0'..=b'9' | b'-' | b'+' | b'.' | b'e' | b'E')
                {
                    i += 1;
                }
                if let Some(kind) = leaf {
                    check_number(kind, &b[start..i], plain, self.allow).map_err(named)?;
                }
                Ok(Step::At(i))
            }
            Some(open @ (b'{' | b'[')) => {
                let inner = depth + 1;
                if inner > self.limits.max_depth {
                    return Err(too_deep(self.limits, i));
                }
                match (open, shape) {
                    (b'{', Some(Shape::Object(columns))) => {
                        self.object(i + 1, inner, Fields::Named(columns), Some(path))
                    }
                    (b'{', Some(Shape::Map(values))) => {
                        self.object(i + 1, inner, Fields::Every(values), Some(path))
                    }
                    (b'[', Some(Shape::List(element))) => self.array(i + 1, inner, element, path),
                    // Nothing to check inside: walked for depth only.
                    _ => walk(b, i, depth, true, self.limits).map(Step::At),
                }
            }
            Some(b't' | b'f' | b'n') => {
                while i < b.len() && b[i].is_ascii_lowercase() {
                    i += 1;
                }
                Ok(Step::At(i))
            }
            _ => Ok(Step::Broke(i, depth)),
        }
    }
}

fn skip_whitespace(b: &[u8], mut i: usize) -> usize {
    while i < b.len() && matches!(b[i], b' ' | b'\n' | b'\r' | b'\t') {
        i += 1;
    }
    i
}

/// Walks from `i` at nesting `depth` for depth only: strings skipped,
/// brackets counted. With `nested`, returns after the bracket that brings
/// the depth back to where it started; otherwise at the end.
fn walk(
    b: &[u8],
    mut i: usize,
    depth: usize,
    nested: bool,
    limits: &Limits,
) -> Result<usize, BadRecord> {
    let base = depth;
    let mut depth = depth;
    while i < b.len() {
        match b[i] {
            b'"' => i = string_end(b, i + 1).0 + 1,
            b'{' | b'[' => {
                depth += 1;
                if depth > limits.max_depth {
                    return Err(too_deep(limits, i));
                }
                i += 1;
            }
            b'}' | b']' => {
                depth = depth.saturating_sub(1);
                i += 1;
                if nested && depth == base {
                    return Ok(i);
                }
            }
            _ => i += 1,
        }
    }
    Ok(i)
}

fn with_column(mut bad: BadRecord, column: &str) -> BadRecord {
    bad.detail = format!("column {column:?}: {}", bad.detail);
    bad
}

fn lossy(detail: String) -> BadRecord {
    BadRecord::new(BadReason::LossyConversion, detail)
}

/// Shows at most 40 bytes of a literal in an error.
fn shown(lit: &[u8]) -> String {
    let cut = &lit[..lit.len().min(40)];
    let more = if lit.len() > cut.len() { "..." } else { "" };
    format!("{}{more}", String::from_utf8_lossy(cut))
}

/// A JSON number literal in parts.
struct Number<'a> {
    negative: bool,
    int: &'a [u8],
    frac: &'a [u8],
    /// The exponent, saturated at +-10^9.
    exp: i64,
    /// Has a fraction part or an exponent (arrow-json then reads an
    /// integer column's value through an `f64`).
    float_form: bool,
}

/// Splits a JSON number literal; `None` when it is not one (the decoder
/// reports it).
fn parse_number(lit: &[u8]) -> Option<Number<'_>> {
    let mut i = 0;
    let negative = lit.first() == Some(&b'-');
    if negative {
        i += 1;
    }
    let digits = |from: usize| {
        lit[from..]
            .iter()
            .position(|b| !b.is_ascii_digit())
            .map_or(lit.len(), |p| from + p)
    };
    let int_end = digits(i);
    let int = &lit[i..int_end];
    if int.is_empty() {
        return None;
    }
    i = int_end;
    let mut frac: &[u8] = &[];
    let mut float_form = false;
    if lit.get(i) == Some(&b'.') {
        let end = digits(i + 1);
        frac = &lit[i + 1..end];
        if frac.is_empty() {
            return None;
        }
        i = end;
        float_form = true;
    }
    let mut exp: i64 = 0;
    if matches!(lit.get(i), Some(b'e' | b'E')) {
        float_form = true;
        i += 1;
        let negative_exp = match lit.get(i) {
            Some(b'-') => {
                i += 1;
                true
            }
            Some(b'+') => {
                i += 1;
                false
            }
            _ => false,
        };
        let end = digits(i);
        if end == i {
            return None;
        }
        for d in &lit[i..end] {
            exp = (exp * 10 + i64::from(d - b'0')).min(1_000_000_000);
        }
        if negative_exp {
            exp = -exp;
        }
        i = end;
    }
    (i == lit.len()).then_some(Number {
        negative,
        int,
        frac,
        exp,
        float_form,
    })
}

/// The integer a number literal denotes, truncated toward zero; `Err` when
/// it has more than 38 digits before the point (beyond every column).
/// `exact` says whether the truncation dropped nothing.
fn integer_value(num: &Number<'_>) -> Result<(i128, bool), ()> {
    // value = digits * 10^scale
    let frac_len = i64::try_from(num.frac.len()).map_err(|_| ())?;
    let scale = num.exp - frac_len;
    let all = num.int.iter().chain(num.frac);
    let total = num.int.len() + num.frac.len();
    let lead = all.clone().take_while(|d| **d == b'0').count();
    let significant = total - lead;
    if significant == 0 {
        return Ok((0, true));
    }
    // Digits kept before the point, and whether those dropped are zeros.
    let (keep, exact) = if scale >= 0 {
        (significant, true)
    } else {
        let drop = usize::try_from(-scale).map_err(|_| ())?;
        if drop >= significant {
            (0, false)
        } else {
            let dropped = all.clone().skip(total - drop);
            (significant - drop, dropped.clone().all(|d| *d == b'0'))
        }
    };
    let zeros = usize::try_from(scale.max(0)).map_err(|_| ())?;
    if keep + zeros > 38 {
        return Err(());
    }
    let mut v: i128 = 0;
    for d in all.skip(lead).take(keep) {
        v = v * 10 + i128::from(d - b'0');
    }
    for _ in 0..zeros {
        v *= 10;
    }
    Ok((if num.negative { -v } else { v }, exact))
}

fn check_integer(lit: &[u8], min: i128, max: i128, allow: &Allow) -> Result<(), BadRecord> {
    let Some(num) = parse_number(lit) else {
        return Ok(());
    };
    let out_of_range = || lossy(format!("{} is out of range [{min}, {max}]", shown(lit)));
    let (v, exact) = integer_value(&num).map_err(|()| out_of_range())?;
    if !exact && !allow.fraction_to_integer {
        return Err(lossy(format!(
            "{} has a fraction; the column takes integers (coercion fraction-to-integer truncates)",
            shown(lit)
        )));
    }
    if v < min || v > max {
        return Err(out_of_range());
    }
    // arrow-json reads a fraction or exponent through an f64: exact only
    // where the f64 holds the integer.
    if exact && num.float_form && (v as f64) as i128 != v {
        return Err(lossy(format!(
            "{} is read through a 64-bit float, which does not hold it exactly; write it as an integer",
            shown(lit)
        )));
    }
    Ok(())
}

fn check_float(lit: &[u8], f32_column: bool) -> Result<(), BadRecord> {
    // Fast path: without an exponent, 30 characters can neither overflow
    // nor underflow an f32 (or f64).
    if lit.len() <= 30 && !lit.iter().any(|b| matches!(b, b'e' | b'E')) {
        return Ok(());
    }
    let Some(num) = parse_number(lit) else {
        return Ok(());
    };
    let Ok(text) = std::str::from_utf8(lit) else {
        return Ok(());
    };
    let (finite, zero) = if f32_column {
        match text.parse::<f32>() {
            Ok(v) => (v.is_finite(), v == 0.0),
            Err(_) => return Ok(()),
        }
    } else {
        match text.parse::<f64>() {
            Ok(v) => (v.is_finite(), v == 0.0),
            Err(_) => return Ok(()),
        }
    };
    let width = if f32_column { 32 } else { 64 };
    if !finite {
        return Err(lossy(format!(
            "{} is out of range of a {width}-bit float",
            shown(lit)
        )));
    }
    let nonzero = num.int.iter().chain(num.frac).any(|d| *d != b'0');
    if zero && nonzero {
        return Err(lossy(format!(
            "{} is too small for a {width}-bit float (it would be 0)",
            shown(lit)
        )));
    }
    Ok(())
}

/// An i64 (timestamp) column.
const I64: Kind = Kind::integer(i64::MIN as i128, i64::MAX as i128);
/// An i32 (date) column.
const I32: Kind = Kind::integer(i32::MIN as i128, i32::MAX as i128);

/// Checks a number literal; `plain` when it is digits after an optional
/// minus sign.
fn check_number(kind: Kind, lit: &[u8], plain: bool, allow: &Allow) -> Result<(), BadRecord> {
    match kind {
        Kind::Integer {
            min,
            max,
            digits,
            neg_digits,
        } => {
            // Fast path: a plain integer short enough to be in range.
            if plain {
                let (len, limit) = match lit.first() {
                    Some(b'-') => (lit.len() - 1, neg_digits),
                    _ => (lit.len(), digits),
                };
                if len >= 1 && len <= usize::from(limit) {
                    return Ok(());
                }
            }
            check_integer(lit, min, max, allow)
        }
        Kind::Timestamp { .. } => check_number(I64, lit, plain, allow),
        Kind::Date => check_number(I32, lit, plain, allow),
        Kind::Float32 => check_float(lit, true),
        Kind::Float64 => check_float(lit, false),
    }
}

fn check_string(kind: Kind, s: &[u8], escaped: bool, allow: &Allow) -> Result<(), BadRecord> {
    match kind {
        Kind::Integer { .. } | Kind::Float32 | Kind::Float64 => {
            if allow.string_to_number {
                return Ok(());
            }
            let text = if escaped {
                serde_json::from_slice::<String>(&key_with_quotes(s)).unwrap_or_default()
            } else {
                String::from_utf8_lossy(s).into_owned()
            };
            let t = text.trim();
            let numeric = parse_number(t.as_bytes()).is_some()
                || matches!(
                    t.to_ascii_lowercase().as_str(),
                    "nan" | "inf" | "-inf" | "+inf" | "infinity" | "-infinity"
                );
            if numeric {
                Err(lossy(format!(
                    "the string \"{}\" in {} column (coercion string-to-number parses it)",
                    shown(t.as_bytes()),
                    kind.name()
                )))
            } else {
                Err(BadRecord::new(
                    BadReason::SchemaMismatch,
                    format!("the string \"{}\" in {} column", shown(s), kind.name()),
                ))
            }
        }
        Kind::Timestamp { digits } => {
            if allow.truncate_time {
                return Ok(());
            }
            // The fractional seconds: the digits after the first '.'.
            if let Some(dot) = memchr::memchr(b'.', s) {
                let frac = &s[dot + 1..];
                let len = frac.iter().take_while(|d| d.is_ascii_digit()).count();
                if frac[..len]
                    .iter()
                    .skip(usize::from(digits))
                    .any(|d| *d != b'0')
                {
                    return Err(lossy(format!(
                        "\"{}\" is more precise than the column, which keeps {digits} fractional digits (coercion truncate-time drops the rest)",
                        shown(s)
                    )));
                }
            }
            Ok(())
        }
        Kind::Date => {
            // arrow parses a longer string (not a signed year) as a
            // date-time and keeps the date of its UTC instant.
            if !allow.truncate_time && s.len() > 10 && !matches!(s.first(), Some(b'+' | b'-')) {
                return Err(lossy(format!(
                    "\"{}\" is a date-time in a date column (coercion truncate-time keeps its UTC date)",
                    shown(s)
                )));
            }
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: Limits = Limits {
        max_bytes: 1024,
        max_depth: 8,
    };

    fn long() -> Columns {
        Columns::new(
            [(
                "n".to_owned(),
                Kind::integer(i128::from(i64::MIN), i128::from(i64::MAX)),
            )],
            Allow::default(),
        )
    }

    fn reason(payload: &str, columns: &Columns) -> Option<BadReason> {
        scan(payload.as_bytes(), &LIMITS, columns)
            .err()
            .map(|b| b.reason)
    }

    #[test]
    fn integers_take_exact_integers_only() {
        let c = long();
        for ok in [
            "1",
            "-1",
            "0",
            "1.0",
            "1.000",
            "1e3",
            "1.5e1",
            "-0.0",
            "0e999999",
            "9223372036854775807",
            "-9223372036854775808",
            "123456789012",
        ] {
            assert_eq!(reason(&format!(r#"{{"n":{ok}}}"#), &c), None, "{ok}");
        }
        for lossy in [
            "1.5",
            "-0.5",
            "1e-1",
            "1.55e1",
            "1e999999",
            "9223372036854775808",
            "-9223372036854775809",
            "9007199254740993.0",
            "1e19",
            "\"12\"",
        ] {
            assert_eq!(
                reason(&format!(r#"{{"a":"x","n":{lossy},"b":2}}"#), &c),
                Some(BadReason::LossyConversion),
                "{lossy}"
            );
        }
        let digits400 = "7".repeat(400);
        assert_eq!(
            reason(&format!(r#"{{"n":{digits400}}}"#), &c),
            Some(BadReason::LossyConversion)
        );
        assert_eq!(
            reason(r#"{"n":"abc"}"#, &c),
            Some(BadReason::SchemaMismatch)
        );
    }

    #[test]
    fn only_fields_of_the_schema_are_checked() {
        let c = long();
        for ok in [
            r#"{"m":1.5}"#,
            r#"{"x":{"n":1.5}}"#,
            r#"{"x":[1.5,"n",2.5],"n":2}"#,
            r#"{"s":"n","n":3}"#,
            r#"{"n":null}"#,
            r#"[1.5]"#,
        ] {
            assert_eq!(reason(ok, &c), None, "{ok}");
        }
        // An escaped key is the same key.
        assert_eq!(
            reason(r#"{"\u006e":1.5}"#, &c),
            Some(BadReason::LossyConversion)
        );
        // A string with an escaped quote does not end early.
        assert_eq!(
            reason(r#"{"s":"a\"n\":1.5","n":1.5}"#, &c),
            Some(BadReason::LossyConversion)
        );
        assert_eq!(reason(r#"{"s":"a\"n\":1.5","n":1}"#, &c), None);
    }

    /// `{"s": {"a": long, "t": {"b": long}}, "l": [long], "ls": [{"q":
    /// long}], "m": {string: long}}`
    fn nested() -> Columns {
        let long = || Kind::integer(i128::from(i64::MIN), i128::from(i64::MAX));
        let allow = Allow::default();
        let inner = Columns::new([("b".to_owned(), long())], allow);
        let s = Columns::new(
            [
                ("a".to_owned(), Shape::Leaf(long())),
                ("t".to_owned(), Shape::Object(inner)),
            ],
            allow,
        );
        let q = Columns::new([("q".to_owned(), long())], allow);
        Columns::new(
            [
                ("s".to_owned(), Shape::Object(s)),
                ("l".to_owned(), Shape::List(Box::new(Shape::Leaf(long())))),
                ("ls".to_owned(), Shape::List(Box::new(Shape::Object(q)))),
                ("m".to_owned(), Shape::Map(Box::new(Shape::Leaf(long())))),
            ],
            allow,
        )
    }

    #[test]
    fn values_inside_structs_lists_and_maps_are_checked_too() {
        let c = nested();
        for ok in [
            r#"{"s":{"a":1,"t":{"b":2.0}},"l":[1,2,3],"ls":[{"q":1},{}],"m":{"x":1,"y":null}}"#,
            r#"{"s":null,"l":null,"ls":[],"m":{}}"#,
            r#"{"s":{"other":1.5,"t":{"c":[1.5]}},"x":{"a":1.5}}"#,
            r#"{"l":[],"m":{"k":{"not":"checked"}}}"#,
        ] {
            assert_eq!(reason(ok, &c), None, "{ok}");
        }
        for (lossy, at) in [
            (r#"{"s":{"a":1.5}}"#, "s.a"),
            (r#"{"s":{"t":{"b":"12"}}}"#, "s.t.b"),
            (r#"{"l":[1,2.5]}"#, "l[]"),
            (r#"{"ls":[{"q":1},{"q":-0.5}]}"#, "ls[].q"),
            (r#"{"m":{"x":1,"y":"12"}}"#, "m.y"),
        ] {
            let bad = scan(lossy.as_bytes(), &LIMITS, &c).unwrap_err();
            assert_eq!(bad.reason, BadReason::LossyConversion, "{lossy}");
            assert!(
                bad.detail.contains(&format!("column {at:?}")),
                "{lossy}: {}",
                bad.detail
            );
        }
        // Depth is bounded inside checked values as outside.
        let deep = format!(r#"{{"s":{{"t":{}1{}}}}}"#, "[".repeat(10), "]".repeat(10));
        assert_eq!(reason(&deep, &c), Some(BadReason::TooDeep));
        let deep = format!(r#"{{"l":[{}1{}]}}"#, "[".repeat(10), "]".repeat(10));
        assert_eq!(reason(&deep, &c), Some(BadReason::TooDeep));
        // Broken JSON inside is the decoder's to report, not the scan's.
        for broken in [
            r#"{"s":{"a":1,,"t":1}}"#,
            r#"{"l":[1 2]}"#,
            r#"{"m":{"x" 1}}"#,
        ] {
            assert_eq!(reason(broken, &c), None, "{broken}");
        }
    }

    #[test]
    fn coercions_allow_what_they_name() {
        let allow = Allow {
            fraction_to_integer: true,
            string_to_number: true,
            truncate_time: true,
        };
        let c = Columns::new(
            [
                ("n".to_owned(), Kind::integer(-128, 127)),
                ("t".to_owned(), Kind::Timestamp { digits: 6 }),
                ("d".to_owned(), Kind::Date),
            ],
            allow,
        );
        assert_eq!(
            reason(
                r#"{"n":1.5,"t":"2024-01-01T00:00:00.1234567Z","d":"2024-01-01T10:00:00Z"}"#,
                &c
            ),
            None
        );
        assert_eq!(reason(r#"{"n":"12"}"#, &c), None);
        // Out of range stays bad.
        assert_eq!(
            reason(r#"{"n":128.5}"#, &c),
            Some(BadReason::LossyConversion)
        );
        assert_eq!(
            reason(r#"{"t":1e999}"#, &c),
            Some(BadReason::LossyConversion)
        );
        let strict = Columns::new(
            [
                ("t".to_owned(), Kind::Timestamp { digits: 3 }),
                ("d".to_owned(), Kind::Date),
            ],
            Allow::default(),
        );
        assert_eq!(
            reason(
                r#"{"t":"2024-01-01T00:00:00.123000Z","d":"2024-01-01"}"#,
                &strict
            ),
            None
        );
        assert_eq!(
            reason(r#"{"t":"2024-01-01T00:00:00.1234Z"}"#, &strict),
            Some(BadReason::LossyConversion)
        );
        assert_eq!(
            reason(r#"{"d":"2024-01-01T23:00:00-05:00"}"#, &strict),
            Some(BadReason::LossyConversion)
        );
    }

    #[test]
    fn floats_take_finite_numbers_and_no_strings() {
        let c = Columns::new(
            [
                ("f".to_owned(), Kind::Float32),
                ("d".to_owned(), Kind::Float64),
            ],
            Allow::default(),
        );
        for ok in [
            "0.1",
            "1e38",
            "-1.5",
            "0e-999",
            "123456789012345678901234567890",
        ] {
            assert_eq!(reason(&format!(r#"{{"f":{ok}}}"#), &c), None, "{ok}");
        }
        assert_eq!(reason(r#"{"d":1e300}"#, &c), None);
        for lossy in [
            r#"{"f":1e39}"#,
            r#"{"d":1e999}"#,
            r#"{"d":1e-999}"#,
            r#"{"f":"1.5"}"#,
            r#"{"d":"NaN"}"#,
        ] {
            assert_eq!(
                reason(lossy, &c),
                Some(BadReason::LossyConversion),
                "{lossy}"
            );
        }
    }

    #[test]
    fn limits_bound_size_and_depth() {
        let c = Columns::default();
        let deep = |d: usize| format!("{}{}", "[".repeat(d), "]".repeat(d));
        assert_eq!(reason(&deep(8), &c), None);
        assert_eq!(reason(&deep(9), &c), Some(BadReason::TooDeep));
        // An unclosed nesting is caught as soon as it is too deep.
        assert_eq!(reason(&"{\"a\":".repeat(9), &c), Some(BadReason::TooDeep));
        // Brackets in strings do not count.
        assert_eq!(reason(&format!("[\"{}\"]", "[".repeat(100)), &c), None);
        let big = format!("\"{}\"", "x".repeat(1022));
        assert_eq!(reason(&big, &c), None);
        let bigger = format!("\"{}\"", "x".repeat(1023));
        assert_eq!(reason(&bigger, &c), Some(BadReason::TooLarge));
    }
}
