//! The compiler errors of common misuses name the fix (`#[diagnostic::on_unimplemented]`
//! on the crate's traits): each file under `ui/` must fail to compile with the error in
//! its `.stderr`. One test, few cases: trybuild builds the dependencies again in a
//! target directory of its own. `TRYBUILD=overwrite` rewrites the expected errors.

#[test]
fn misuses_fail_with_errors_that_name_the_fix() {
    let cases = trybuild::TestCases::new();
    cases.compile_fail("tests/diagnostics/ui/*.rs");
}
