//! The job file's transforms on Arrow record batches: projection, renaming,
//! filters on a column against a literal, computed columns. Each is planned
//! against the schema it receives, so a wrong column or type is an error
//! before the job starts, naming the step.

use std::sync::Arc;

use arrow_arith::numeric;
use arrow_array::{
    Array, ArrayRef, BooleanArray, Datum, Float64Array, Int64Array, RecordBatch, Scalar,
    StringArray,
};
use arrow_cast::cast;
use arrow_ord::cmp;
use arrow_schema::{DataType, Field, Schema, SchemaRef};
use arrow_select::filter::filter_record_batch;
use tinyflow_api::{Operator, OperatorContext, Output, StreamError, StreamResult};

use crate::JobFileError;
use crate::jobfile::TransformSection;

/// A comparison.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CmpOp {
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
}

/// A literal in a filter or expression.
#[derive(Debug, Clone, PartialEq)]
enum Literal {
    Int(i64),
    Float(f64),
    Str(String),
    Bool(bool),
}

/// An arithmetic operator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ArithOp {
    Add,
    Sub,
    Mul,
    Div,
}

/// Where a column is: the index of a top-level column, then of a field
/// in each struct below it (`buyer.address.city`).
type ColumnPath = Vec<usize>;

#[derive(Debug, Clone, PartialEq)]
enum Operand {
    Column(ColumnPath),
    Literal(Literal),
}

/// One planned step.
#[derive(Debug, Clone, PartialEq)]
enum TransformOp {
    /// Keep the columns at these paths, in order (a nested field becomes a
    /// top-level column).
    Select(Vec<ColumnPath>),
    /// Same columns, new schema (renamed fields).
    Rename,
    /// Keep rows where the column compares true with the literal.
    Compare {
        column: ColumnPath,
        op: CmpOp,
        value: Literal,
    },
    /// Keep rows where the column is null (`is_null`) or not null.
    Null { column: ColumnPath, is_null: bool },
    /// Compute a column; `replace` is the index of a column it replaces,
    /// appended when `None`.
    Compute { expr: Expr, replace: Option<usize> },
}

/// `left` alone, or `left op right`, computed as `ty`.
#[derive(Debug, Clone, PartialEq)]
struct Expr {
    left: Operand,
    op: Option<(ArithOp, Operand)>,
    ty: DataType,
}

/// A planned step with the schema it outputs.
#[derive(Debug, Clone)]
struct Transform {
    op: TransformOp,
    output: SchemaRef,
}

/// All steps, in order, from an input schema.
#[derive(Debug, Clone)]
pub struct Transforms {
    steps: Vec<Transform>,
    input: SchemaRef,
}

impl Transforms {
    /// Plans `sections` against `input`.
    pub fn plan(sections: &[TransformSection], input: SchemaRef) -> Result<Self, JobFileError> {
        let mut schema = Arc::clone(&input);
        let mut steps = Vec::with_capacity(sections.len());
        for (i, s) in sections.iter().enumerate() {
            let key = format!("transforms[{i}]");
            let step = plan_step(&key, s, &schema)?;
            schema = Arc::clone(&step.output);
            steps.push(step);
        }
        Ok(Transforms { steps, input })
    }

    /// The schema the last step outputs.
    pub fn output(&self) -> SchemaRef {
        self.steps
            .last()
            .map_or_else(|| Arc::clone(&self.input), |s| Arc::clone(&s.output))
    }

    /// Applies every step to a batch.
    pub fn apply(&self, batch: &RecordBatch) -> Result<RecordBatch, String> {
        let mut b = batch.clone();
        for (i, step) in self.steps.iter().enumerate() {
            b = apply_step(step, &b).map_err(|e| format!("transforms[{i}]: {e}"))?;
            if b.num_rows() == 0 {
                return Ok(RecordBatch::new_empty(self.output()));
            }
        }
        Ok(b)
    }
}

fn column_index(key: &str, schema: &Schema, name: &str) -> Result<usize, JobFileError> {
    schema.index_of(name).map_err(|_| {
        let names: Vec<&str> = schema.fields().iter().map(|f| f.name().as_str()).collect();
        JobFileError::new(
            key,
            format!(
                "no column `{name}` at this step; columns are: {}",
                names.join(", ")
            ),
        )
    })
}

/// The path of column `name`: a top-level column, or a field inside
/// struct columns, `a.b.c` (a top-level name with dots is taken first).
fn column_path(key: &str, schema: &Schema, name: &str) -> Result<ColumnPath, JobFileError> {
    if let Ok(i) = schema.index_of(name) {
        return Ok(vec![i]);
    }
    let mut parts = name.split('.');
    let first = parts.next().unwrap_or_default();
    let Ok(top) = schema.index_of(first) else {
        return column_index(key, schema, name).map(|i| vec![i]);
    };
    let mut path = vec![top];
    let mut field = schema.field(top);
    for part in parts {
        let DataType::Struct(fields) = field.data_type() else {
            return Err(JobFileError::new(
                key,
                format!(
                    "`{name}`: `{}` is {}, not a struct",
                    field.name(),
                    field.data_type()
                ),
            ));
        };
        let Some((i, f)) = fields.find(part) else {
            let names: Vec<&str> = fields.iter().map(|f| f.name().as_str()).collect();
            return Err(JobFileError::new(
                key,
                format!(
                    "`{name}`: struct `{}` has no field `{part}`; its fields are: {}",
                    field.name(),
                    names.join(", ")
                ),
            ));
        };
        path.push(i);
        field = f;
    }
    Ok(path)
}

/// The field at `path`; nullable if any struct above it is.
fn field_at(schema: &Schema, path: &[usize]) -> Field {
    let mut field = schema.field(path[0]).clone();
    let mut nullable = field.is_nullable();
    for &i in &path[1..] {
        let DataType::Struct(fields) = field.data_type() else {
            unreachable!("planned by column_path");
        };
        field = (*fields[i]).clone();
        nullable |= field.is_nullable();
    }
    field.with_nullable(nullable)
}

/// The values at `path` in `batch`: a field of a null struct is null.
fn column_at(batch: &RecordBatch, path: &[usize]) -> Result<ArrayRef, String> {
    let mut col = Arc::clone(batch.column(path[0]));
    for &i in &path[1..] {
        let parent = col
            .as_any()
            .downcast_ref::<arrow_array::StructArray>()
            .ok_or("planned as a struct")?;
        let child = parent.column(i);
        let nulls = arrow_buffer::NullBuffer::union(parent.nulls(), child.nulls());
        let data = child
            .to_data()
            .into_builder()
            .nulls(nulls)
            .build()
            .map_err(|e| e.to_string())?;
        col = arrow_array::make_array(data);
    }
    Ok(col)
}

fn plan_step(
    key: &str,
    s: &TransformSection,
    schema: &SchemaRef,
) -> Result<Transform, JobFileError> {
    let given = [
        s.select.is_some(),
        s.rename.is_some(),
        s.filter.is_some(),
        s.compute.is_some(),
    ]
    .iter()
    .filter(|g| **g)
    .count();
    if given != 1 {
        return Err(JobFileError::new(
            key,
            format!("expected exactly one of select, rename, filter, compute; found {given}"),
        ));
    }
    if let Some(cols) = &s.select {
        let key = format!("{key}.select");
        if cols.is_empty() {
            return Err(JobFileError::new(key, "expected at least one column"));
        }
        let mut paths = Vec::with_capacity(cols.len());
        let mut fields: Vec<Field> = Vec::with_capacity(cols.len());
        for c in cols {
            let path = column_path(&key, schema, c)?;
            // A nested field is named by its own name: `buyer.name` -> `name`.
            let field = field_at(schema, &path);
            if paths.contains(&path) || fields.iter().any(|f| f.name() == field.name()) {
                return Err(JobFileError::new(
                    key,
                    format!(
                        "column `{}` selected twice (`{c}`; a nested field is named by its own name)",
                        field.name()
                    ),
                ));
            }
            paths.push(path);
            fields.push(field);
        }
        return Ok(Transform {
            op: TransformOp::Select(paths),
            output: Arc::new(Schema::new(fields)),
        });
    }
    if let Some(renames) = &s.rename {
        let key = format!("{key}.rename");
        let mut fields: Vec<Field> = schema.fields().iter().map(|f| (**f).clone()).collect();
        for (old, new) in renames {
            let i = column_index(&format!("{key}.{old}"), schema, old)?;
            fields[i] = fields[i].clone().with_name(new.clone());
        }
        let mut seen = std::collections::BTreeSet::new();
        for f in &fields {
            if !seen.insert(f.name().clone()) {
                return Err(JobFileError::new(
                    key,
                    format!("two columns would be named `{}`", f.name()),
                ));
            }
        }
        return Ok(Transform {
            op: TransformOp::Rename,
            output: Arc::new(Schema::new(fields)),
        });
    }
    if let Some(f) = &s.filter {
        let key = format!("{key}.filter");
        let op = parse_filter(&key, f, schema)?;
        return Ok(Transform {
            op,
            output: Arc::clone(schema),
        });
    }
    let c = s.compute.as_ref().expect("one of the four is set");
    let key = format!("{key}.compute");
    if c.column.is_empty() {
        return Err(JobFileError::new(
            format!("{key}.column"),
            "expected a column name",
        ));
    }
    let expr = parse_expr(&format!("{key}.expr"), &c.expr, schema)?;
    let replace = schema.index_of(&c.column).ok();
    let mut fields: Vec<Field> = schema.fields().iter().map(|f| (**f).clone()).collect();
    let nullable = operand_nullable(&expr.left, schema)
        || expr
            .op
            .as_ref()
            .is_some_and(|(_, r)| operand_nullable(r, schema));
    let field = Field::new(&c.column, expr.ty.clone(), nullable);
    match replace {
        Some(i) => fields[i] = field,
        None => fields.push(field),
    }
    Ok(Transform {
        op: TransformOp::Compute { expr, replace },
        output: Arc::new(Schema::new(fields)),
    })
}

fn operand_nullable(o: &Operand, schema: &Schema) -> bool {
    match o {
        Operand::Column(path) => field_at(schema, path).is_nullable(),
        Operand::Literal(_) => false,
    }
}

fn parse_literal(text: &str) -> Option<Literal> {
    let t = text.trim();
    if let Some(s) = t
        .strip_prefix('\'')
        .and_then(|r| r.strip_suffix('\''))
        .or_else(|| t.strip_prefix('"').and_then(|r| r.strip_suffix('"')))
    {
        return Some(Literal::Str(s.to_owned()));
    }
    match t {
        "true" => return Some(Literal::Bool(true)),
        "false" => return Some(Literal::Bool(false)),
        _ => {}
    }
    if let Ok(i) = t.parse::<i64>() {
        return Some(Literal::Int(i));
    }
    t.parse::<f64>()
        .ok()
        .filter(|f| f.is_finite())
        .map(Literal::Float)
}

fn is_numeric(t: &DataType) -> bool {
    t.is_integer() || t.is_floating()
}

fn parse_filter(key: &str, text: &str, schema: &Schema) -> Result<TransformOp, JobFileError> {
    let t = text.trim();
    let lower = t.to_ascii_lowercase();
    for (suffix, is_null) in [(" is not null", false), (" is null", true)] {
        if let Some(col) = lower.strip_suffix(suffix) {
            let column = column_path(key, schema, t[..col.len()].trim())?;
            return Ok(TransformOp::Null { column, is_null });
        }
    }
    // Longest operators first, so `<=` is not read as `<`.
    let ops = [
        ("==", CmpOp::Eq),
        ("!=", CmpOp::Ne),
        ("<=", CmpOp::Le),
        (">=", CmpOp::Ge),
        ("<", CmpOp::Lt),
        (">", CmpOp::Gt),
    ];
    let Some((pos, sym, op)) = ops
        .iter()
        .filter_map(|(sym, op)| t.find(sym).map(|p| (p, *sym, *op)))
        .min_by_key(|(p, sym, _)| (*p, std::cmp::Reverse(sym.len())))
    else {
        return Err(JobFileError::new(
            key,
            format!(
                "`{t}`: expected `<column> <op> <literal>` with op one of == != < <= > >=, \
                 or `<column> is null` / `<column> is not null`"
            ),
        ));
    };
    let name = t[..pos].trim();
    let value_text = t[pos + sym.len()..].trim();
    let column = column_path(key, schema, name)?;
    let value = parse_literal(value_text).ok_or_else(|| {
        JobFileError::new(
            key,
            format!(
                "`{value_text}` is not a literal; expected a number, true/false or a 'quoted string'"
            ),
        )
    })?;
    let field = field_at(schema, &column);
    let ty = field.data_type();
    let fits = match &value {
        Literal::Int(_) | Literal::Float(_) => is_numeric(ty),
        Literal::Str(_) => matches!(ty, DataType::Utf8 | DataType::LargeUtf8),
        Literal::Bool(_) => matches!(ty, DataType::Boolean),
    };
    if !fits {
        return Err(JobFileError::new(
            key,
            format!("column `{name}` is {ty}, which cannot be compared with `{value_text}`"),
        ));
    }
    if matches!(value, Literal::Bool(_)) && !matches!(op, CmpOp::Eq | CmpOp::Ne) {
        return Err(JobFileError::new(
            key,
            "booleans compare with == or != only",
        ));
    }
    Ok(TransformOp::Compare { column, op, value })
}

fn parse_operand(key: &str, text: &str, schema: &Schema) -> Result<Operand, JobFileError> {
    let t = text.trim();
    if t.is_empty() {
        return Err(JobFileError::new(key, "an operand is missing"));
    }
    if column_path(key, schema, t).is_err()
        && let Some(l) = parse_literal(t)
    {
        return match l {
            Literal::Int(_) | Literal::Float(_) => Ok(Operand::Literal(l)),
            _ => Err(JobFileError::new(
                key,
                format!("`{t}`: only number literals take part in arithmetic"),
            )),
        };
    }
    Ok(Operand::Column(column_path(key, schema, t)?))
}

fn operand_type(o: &Operand, schema: &Schema) -> DataType {
    match o {
        Operand::Column(path) => field_at(schema, path).data_type().clone(),
        Operand::Literal(Literal::Int(_)) => DataType::Int64,
        Operand::Literal(_) => DataType::Float64,
    }
}

fn parse_expr(key: &str, text: &str, schema: &Schema) -> Result<Expr, JobFileError> {
    let t = text.trim();
    // The operator is the first of + - * / after the first character (a
    // leading minus belongs to a literal) with spaces around it, or any.
    let found = t.char_indices().skip(1).find(|(i, c)| {
        matches!(c, '+' | '-' | '*' | '/')
            && !t[..*i].trim_end().ends_with(['+', '-', '*', '/'])
            && !t[..*i].ends_with('e')
    });
    let Some((pos, sym)) = found else {
        let left = parse_operand(key, t, schema)?;
        let ty = operand_type(&left, schema);
        return Ok(Expr { left, op: None, ty });
    };
    let left = parse_operand(key, &t[..pos], schema)?;
    let right = parse_operand(key, &t[pos + 1..], schema)?;
    for o in [&left, &right] {
        let ty = operand_type(o, schema);
        if !is_numeric(&ty) {
            return Err(JobFileError::new(
                key,
                format!("`{t}`: arithmetic needs numbers, and an operand is {ty}"),
            ));
        }
    }
    let op = match sym {
        '+' => ArithOp::Add,
        '-' => ArithOp::Sub,
        '*' => ArithOp::Mul,
        _ => ArithOp::Div,
    };
    let floating =
        operand_type(&left, schema).is_floating() || operand_type(&right, schema).is_floating();
    // Division is always floating point: 7 / 2 is 3.5, and a zero divisor
    // gives infinity instead of failing the job.
    let ty = if floating || op == ArithOp::Div {
        DataType::Float64
    } else {
        DataType::Int64
    };
    Ok(Expr {
        left,
        op: Some((op, right)),
        ty,
    })
}

fn literal_array(l: &Literal, ty: &DataType) -> Result<ArrayRef, String> {
    let a: ArrayRef = match l {
        Literal::Int(i) => Arc::new(Int64Array::from(vec![*i])),
        Literal::Float(f) => Arc::new(Float64Array::from(vec![*f])),
        Literal::Str(s) => Arc::new(StringArray::from(vec![s.as_str()])),
        Literal::Bool(b) => Arc::new(BooleanArray::from(vec![*b])),
    };
    cast(&a, ty).map_err(|e| e.to_string())
}

fn operand_datum(
    o: &Operand,
    batch: &RecordBatch,
    ty: &DataType,
) -> Result<Box<dyn Datum>, String> {
    Ok(match o {
        Operand::Column(path) => {
            Box::new(cast(&column_at(batch, path)?, ty).map_err(|e| e.to_string())?)
        }
        Operand::Literal(l) => Box::new(Scalar::new(literal_array(l, ty)?)),
    })
}

fn apply_step(step: &Transform, batch: &RecordBatch) -> Result<RecordBatch, String> {
    let out = Arc::clone(&step.output);
    match &step.op {
        TransformOp::Select(idx) => {
            let cols = idx
                .iter()
                .map(|path| column_at(batch, path))
                .collect::<Result<Vec<_>, _>>()?;
            RecordBatch::try_new(out, cols).map_err(|e| e.to_string())
        }
        TransformOp::Rename => {
            RecordBatch::try_new(out, batch.columns().to_vec()).map_err(|e| e.to_string())
        }
        TransformOp::Null { column, is_null } => {
            let col = &column_at(batch, column)?;
            let keep = if *is_null {
                arrow_arith::boolean::is_null(col)
            } else {
                arrow_arith::boolean::is_not_null(col)
            }
            .map_err(|e| e.to_string())?;
            filter_record_batch(batch, &keep).map_err(|e| e.to_string())
        }
        TransformOp::Compare { column, op, value } => {
            let col = &column_at(batch, column)?;
            let ty = col.data_type();
            // Compare integers with a fractional literal as floats.
            let (col, ty) = match (value, ty.is_integer()) {
                (Literal::Float(_), true) => (
                    cast(col, &DataType::Float64).map_err(|e| e.to_string())?,
                    DataType::Float64,
                ),
                _ => (Arc::clone(col), ty.clone()),
            };
            let lit = Scalar::new(literal_array(value, &ty)?);
            let keep = match op {
                CmpOp::Eq => cmp::eq(&col, &lit),
                CmpOp::Ne => cmp::neq(&col, &lit),
                CmpOp::Lt => cmp::lt(&col, &lit),
                CmpOp::Le => cmp::lt_eq(&col, &lit),
                CmpOp::Gt => cmp::gt(&col, &lit),
                CmpOp::Ge => cmp::gt_eq(&col, &lit),
            }
            .map_err(|e| e.to_string())?;
            filter_record_batch(batch, &keep).map_err(|e| e.to_string())
        }
        TransformOp::Compute { expr, replace } => {
            let value: ArrayRef = match &expr.op {
                None => match &expr.left {
                    Operand::Column(path) => column_at(batch, path)?,
                    Operand::Literal(l) => {
                        let one = literal_array(l, &expr.ty)?;
                        let idx = arrow_array::UInt32Array::from(vec![0u32; batch.num_rows()]);
                        arrow_select::take::take(&one, &idx, None).map_err(|e| e.to_string())?
                    }
                },
                Some((op, right)) => {
                    let l = operand_datum(&expr.left, batch, &expr.ty)?;
                    let r = operand_datum(right, batch, &expr.ty)?;
                    match op {
                        ArithOp::Add => numeric::add(l.as_ref(), r.as_ref()),
                        ArithOp::Sub => numeric::sub(l.as_ref(), r.as_ref()),
                        ArithOp::Mul => numeric::mul(l.as_ref(), r.as_ref()),
                        ArithOp::Div => numeric::div(l.as_ref(), r.as_ref()),
                    }
                    .map_err(|e| e.to_string())?
                }
            };
            let mut cols = batch.columns().to_vec();
            match replace {
                Some(i) => cols[*i] = value,
                None => cols.push(value),
            }
            RecordBatch::try_new(out, cols).map_err(|e| e.to_string())
        }
    }
}

/// The transforms as the job's `transforms` operator on record batches, one
/// per subtask; errors name the subtask (`transforms[0]`).
pub(crate) struct TransformOperator {
    name: String,
    transforms: Arc<Transforms>,
}

impl TransformOperator {
    pub(crate) fn new(ctx: &OperatorContext, transforms: Arc<Transforms>) -> Self {
        TransformOperator {
            name: format!("{}[{}]", ctx.name, ctx.subtask),
            transforms,
        }
    }
}

impl Operator<RecordBatch, RecordBatch> for TransformOperator {
    fn process(
        &mut self,
        batches: Vec<RecordBatch>,
        out: &mut Output<'_, RecordBatch>,
    ) -> StreamResult<()> {
        let mut kept = Vec::with_capacity(batches.len());
        for b in &batches {
            let t = self
                .transforms
                .apply(b)
                .map_err(|message| StreamError::User {
                    operator: self.name.clone(),
                    message,
                })?;
            if t.num_rows() > 0 {
                kept.push(t);
            }
        }
        out.emit(kept);
        Ok(())
    }
}

/// The name of the job's transforms node.
pub(crate) const TRANSFORMS_NODE: &str = "transforms";

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]

    use super::*;
    use crate::jobfile::ComputeSection;

    fn schema() -> SchemaRef {
        Arc::new(Schema::new(vec![
            Field::new("id", DataType::Int64, false),
            Field::new("price", DataType::Int64, false),
            Field::new("channel", DataType::Utf8, true),
        ]))
    }

    fn batch() -> RecordBatch {
        RecordBatch::try_new(
            schema(),
            vec![
                Arc::new(Int64Array::from(vec![1, 2, 3, 4])),
                Arc::new(Int64Array::from(vec![50, 150, 250, 1000])),
                Arc::new(StringArray::from(vec![
                    Some("a"),
                    None,
                    Some("b"),
                    Some("a"),
                ])),
            ],
        )
        .unwrap()
    }

    /// `id`, and `buyer: struct<name: string, address: struct<city: string, zip: long>>`
    /// with rows: Ann in Oslo 1000; Bob with no address; a null buyer;
    /// Cy in Lyon 69000.
    fn nested_batch() -> RecordBatch {
        use arrow_array::StructArray;
        let address_fields = vec![
            Field::new("city", DataType::Utf8, true),
            Field::new("zip", DataType::Int64, true),
        ];
        let address = StructArray::new(
            address_fields.clone().into(),
            vec![
                Arc::new(StringArray::from(vec![
                    Some("Oslo"),
                    None,
                    Some("X"),
                    Some("Lyon"),
                ])),
                Arc::new(Int64Array::from(vec![
                    Some(1000),
                    None,
                    Some(5),
                    Some(69000),
                ])),
            ],
            Some(vec![true, false, true, true].into()),
        );
        let buyer_fields = vec![
            Field::new("name", DataType::Utf8, true),
            Field::new("address", DataType::Struct(address_fields.into()), true),
        ];
        // The third buyer is null, though its children hold values.
        let buyer = StructArray::new(
            buyer_fields.clone().into(),
            vec![
                Arc::new(StringArray::from(vec![
                    Some("Ann"),
                    Some("Bob"),
                    Some("Zed"),
                    Some("Cy"),
                ])),
                Arc::new(address),
            ],
            Some(vec![true, true, false, true].into()),
        );
        RecordBatch::try_new(
            Arc::new(Schema::new(vec![
                Field::new("id", DataType::Int64, false),
                Field::new("buyer", DataType::Struct(buyer_fields.into()), true),
            ])),
            vec![
                Arc::new(Int64Array::from(vec![1, 2, 3, 4])),
                Arc::new(buyer),
            ],
        )
        .unwrap()
    }

    #[test]
    fn nested_fields_are_addressed_by_path_and_null_under_a_null_struct() {
        let b = nested_batch();
        let run = |sections: Vec<TransformSection>| {
            Transforms::plan(&sections, b.schema())
                .unwrap()
                .apply(&b)
                .unwrap()
        };
        let ids = |b: &RecordBatch| -> Vec<i64> {
            b.column_by_name("id")
                .unwrap()
                .as_any()
                .downcast_ref::<Int64Array>()
                .unwrap()
                .values()
                .to_vec()
        };
        assert_eq!(ids(&run(vec![filter("buyer.address.city == 'Oslo'")])), [1]);
        // The null buyer's city is null, though the child array holds "X".
        assert_eq!(
            ids(&run(vec![filter("buyer.address.city is null")])),
            [2, 3]
        );
        assert_eq!(ids(&run(vec![filter("buyer.address.zip > 2000")])), [4]);
        let selected = run(vec![TransformSection {
            select: Some(vec![
                "id".into(),
                "buyer.name".into(),
                "buyer.address.zip".into(),
            ]),
            ..TransformSection::default()
        }]);
        let names: Vec<String> = selected
            .schema()
            .fields()
            .iter()
            .map(|f| format!("{}:{}:{}", f.name(), f.data_type(), f.is_nullable()))
            .collect();
        assert_eq!(
            names,
            ["id:Int64:false", "name:Utf8:true", "zip:Int64:true"]
        );
        let zips = selected
            .column(2)
            .as_any()
            .downcast_ref::<Int64Array>()
            .unwrap();
        assert_eq!(
            zips.iter().collect::<Vec<_>>(),
            [Some(1000), None, None, Some(69000)]
        );
        let computed = run(vec![compute("zip_k", "buyer.address.zip / 1000")]);
        let k = computed
            .column(2)
            .as_any()
            .downcast_ref::<Float64Array>()
            .unwrap();
        assert_eq!(
            k.iter().collect::<Vec<_>>(),
            [Some(1.0), None, None, Some(69.0)]
        );
        for (bad, says) in [
            (
                "buyer.town == 'x'",
                "struct `buyer` has no field `town`; its fields are: name, address",
            ),
            ("buyer.name.first == 'x'", "`name` is Utf8, not a struct"),
            ("buyers.name == 'x'", "no column `buyers.name`"),
        ] {
            let err = Transforms::plan(&[filter(bad)], b.schema())
                .unwrap_err()
                .to_string();
            assert!(err.contains(says), "{bad}: {err}");
        }
    }

    fn filter(f: &str) -> TransformSection {
        TransformSection {
            filter: Some(f.into()),
            ..TransformSection::default()
        }
    }

    fn compute(c: &str, e: &str) -> TransformSection {
        TransformSection {
            compute: Some(ComputeSection {
                column: c.into(),
                expr: e.into(),
            }),
            ..TransformSection::default()
        }
    }

    fn ids(b: &RecordBatch) -> Vec<i64> {
        b.column(0)
            .as_any()
            .downcast_ref::<Int64Array>()
            .unwrap()
            .values()
            .to_vec()
    }

    #[test]
    fn filters_compare_numbers_strings_and_nulls() {
        for (f, want) in [
            ("price >= 150", vec![2, 3, 4]),
            ("price < 150", vec![1]),
            ("price == 250", vec![3]),
            ("price != 250", vec![1, 2, 4]),
            ("price > 149.5", vec![2, 3, 4]),
            ("channel == 'a'", vec![1, 4]),
            ("channel is null", vec![2]),
            ("channel is not null", vec![1, 3, 4]),
        ] {
            let t = Transforms::plan(&[filter(f)], schema()).unwrap();
            assert_eq!(ids(&t.apply(&batch()).unwrap()), want, "{f}");
        }
    }

    #[test]
    fn computed_columns_and_projection_and_renaming() {
        let mut rename = std::collections::BTreeMap::new();
        rename.insert("price".to_owned(), "cents".to_owned());
        let t = Transforms::plan(
            &[
                compute("eur", "price / 100"),
                compute("next", "id + 1"),
                TransformSection {
                    select: Some(vec!["next".into(), "price".into(), "eur".into()]),
                    ..TransformSection::default()
                },
                TransformSection {
                    rename: Some(rename),
                    ..TransformSection::default()
                },
            ],
            schema(),
        )
        .unwrap();
        let out = t.apply(&batch()).unwrap();
        let names: Vec<&str> = out
            .schema_ref()
            .fields()
            .iter()
            .map(|f| f.name().as_str())
            .collect();
        assert_eq!(names, ["next", "cents", "eur"]);
        assert_eq!(ids(&out), vec![2, 3, 4, 5]);
        let eur = out
            .column(2)
            .as_any()
            .downcast_ref::<Float64Array>()
            .unwrap();
        assert_eq!(eur.values().to_vec(), vec![0.5, 1.5, 2.5, 10.0]);
        assert_eq!(out.schema(), t.output());
    }

    #[test]
    fn errors_name_the_step_and_what_was_expected() {
        let err =
            |s: TransformSection| Transforms::plan(&[filter("id > 0"), s], schema()).unwrap_err();
        let e = err(filter("prise > 3"));
        assert_eq!(e.key, "transforms[1].filter");
        assert!(
            e.message.contains("no column `prise`") && e.message.contains("price"),
            "{e}"
        );
        let e = err(filter("channel > 3"));
        assert!(e.message.contains("cannot be compared"), "{e}");
        let e = err(filter("price ~ 3"));
        assert!(
            e.message.contains("expected `<column> <op> <literal>`"),
            "{e}"
        );
        let e = err(compute("x", "channel * 2"));
        assert_eq!(e.key, "transforms[1].compute.expr");
        assert!(e.message.contains("arithmetic needs numbers"), "{e}");
        let e = err(TransformSection::default());
        assert!(e.message.contains("exactly one of"), "{e}");
    }
}
