//! A statement and its values: written into the text as literals (the simple query
//! protocol, which a pooler in transaction mode passes whole), or bound to a statement
//! prepared once per connection.

use sqlx::postgres::{PgArguments, PgRow};
use sqlx::{Arguments, Postgres};

use crate::error::NodeError;

/// A statement ready to run: inline (its literals in the text), or bound (the
/// template prepared once per connection, its values bound).
pub(crate) enum Statement {
    Inline(String),
    Bound(&'static str, PgArguments),
}

impl Statement {
    pub(super) async fn fetch_all<'c, E>(self, executor: E) -> Result<Vec<PgRow>, sqlx::Error>
    where
        E: sqlx::Executor<'c, Database = Postgres>,
    {
        match self {
            Statement::Inline(sql) => executor.fetch_all(sql.as_str()).await,
            Statement::Bound(sql, args) => sqlx::query_with(sql, args).fetch_all(executor).await,
        }
    }
}

/// A statement with its `$n` placeholders replaced by literals, in order.
pub(crate) struct Sql {
    template: &'static str,
    values: Vec<String>,
    /// The values bound instead, for a prepared statement.
    bound: Option<Result<PgArguments, String>>,
}

impl Sql {
    pub(crate) fn new(template: &'static str) -> Self {
        Sql {
            template,
            values: Vec::new(),
            bound: None,
        }
    }

    /// A statement of the lock's calls: bound when `prepared`.
    pub(super) fn with(template: &'static str, prepared: bool) -> Self {
        let bound = prepared.then(|| Ok(PgArguments::default()));
        Sql {
            bound,
            ..Sql::new(template)
        }
    }

    /// Binds `value` if the statement is bound; `false` if it is inline.
    fn bind<T>(&mut self, value: T) -> bool
    where
        T: for<'q> sqlx::Encode<'q, Postgres> + sqlx::Type<Postgres> + Send + 'static,
    {
        match &mut self.bound {
            None => false,
            Some(Ok(args)) => {
                if let Err(e) = args.add(value) {
                    self.bound = Some(Err(e.to_string()));
                }
                true
            }
            Some(Err(_)) => true,
        }
    }

    /// The statement, bound or inline.
    pub(super) fn statement(self) -> Result<Statement, NodeError> {
        match self.bound {
            Some(Ok(args)) => Ok(Statement::Bound(self.template, args)),
            Some(Err(e)) => Err(NodeError::Protocol(e.into())),
            None => Ok(Statement::Inline(self.done())),
        }
    }

    /// A string as an escape string (`E'…'`, whose backslashes mean the same whatever
    /// `standard_conforming_strings` says), its quotes and backslashes doubled. A NUL,
    /// which would end the protocol's query string, goes as hex digits instead, which
    /// the server refuses in a `text`.
    fn literal(value: &str) -> String {
        if value.contains('\0') {
            return format!("convert_from({}, 'UTF8')", Self::bytea(value.as_bytes()));
        }
        let mut literal = String::with_capacity(value.len() + 3);
        literal.push_str("E'");
        for c in value.chars() {
            if matches!(c, '\'' | '\\') {
                literal.push(c);
            }
            literal.push(c);
        }
        literal.push('\'');
        literal
    }

    fn bytea(value: &[u8]) -> String {
        let mut literal = String::with_capacity(2 * value.len() + 18);
        literal.push_str("decode('");
        crate::push_hex(&mut literal, value);
        literal.push_str("', 'hex')");
        literal
    }

    pub(crate) fn text(mut self, value: &str) -> Self {
        if !self.bind(value.to_owned()) {
            self.values.push(Self::literal(value));
        }
        self
    }

    pub(super) fn texts<S: AsRef<str>>(mut self, values: impl Iterator<Item = S>) -> Self {
        if self.bound.is_some() {
            self.bind(values.map(|v| v.as_ref().to_owned()).collect::<Vec<_>>());
            return self;
        }
        let items: Vec<String> = values.map(|v| Self::literal(v.as_ref())).collect();
        self.values
            .push(format!("ARRAY[{}]::text[]", items.join(", ")));
        self
    }

    /// A number or a boolean: its `Display` is its literal.
    pub(crate) fn number<T>(mut self, value: T) -> Self
    where
        T: std::fmt::Display + for<'q> sqlx::Encode<'q, Postgres> + sqlx::Type<Postgres>,
        T: Send + 'static,
    {
        let literal = value.to_string();
        if !self.bind(value) {
            self.values.push(literal);
        }
        self
    }

    pub(super) fn numbers(mut self, values: impl IntoIterator<Item = i64>) -> Self {
        if self.bound.is_some() {
            self.bind(values.into_iter().collect::<Vec<_>>());
            return self;
        }
        let items: Vec<String> = values.into_iter().map(|n| n.to_string()).collect();
        self.values
            .push(format!("ARRAY[{}]::int8[]", items.join(", ")));
        self
    }

    /// Bytes as hex digits decoded by the server (`bytea`).
    pub(super) fn bytes(mut self, value: &[u8]) -> Self {
        self.values.push(Self::bytea(value));
        self
    }

    /// A number, or `NULL`.
    pub(super) fn maybe(mut self, value: Option<impl std::fmt::Display>) -> Self {
        let literal = value.map_or_else(|| "NULL".to_owned(), |v| v.to_string());
        self.values.push(literal);
        self
    }

    pub(crate) fn done(self) -> String {
        // One pass over the template: a value is never scanned for placeholders (a key
        // may read `$1`), and `$1` is never the start of `$10`.
        let template = self.template;
        let mut sql = String::with_capacity(
            template.len() + self.values.iter().map(String::len).sum::<usize>(),
        );
        let mut rest = template;
        while let Some(at) = rest.find('$') {
            sql.push_str(&rest[..at]);
            let digits = rest[at + 1..]
                .bytes()
                .take_while(u8::is_ascii_digit)
                .count();
            let value = rest[at + 1..at + 1 + digits]
                .parse::<usize>()
                .ok()
                .and_then(|n| self.values.get(n.checked_sub(1)?));
            match value {
                Some(value) => sql.push_str(value),
                None => sql.push_str(&rest[at..at + 1 + digits]),
            }
            rest = &rest[at + 1 + digits..];
        }
        sql.push_str(rest);
        sql
    }
}
