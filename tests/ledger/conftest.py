from tests.budgets.conftest import fresh_db, fresh_pg, fresh_sqlite  # noqa: F401 - fixtures
