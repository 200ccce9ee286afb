"""A real SQLite database (in memory), schema and rows generated per task: list_tables,
describe_table, query (read-only), execute (INSERT/UPDATE/DELETE).

SQLite's authorizer enforces the access rules inside the engine rather than by parsing SQL: `query`
allows only reads; `execute` allows row changes but no schema changes; ATTACH/DETACH (which could
touch host files), PRAGMA and extension loading are always denied. One statement per call.
"""

from __future__ import annotations

import random
import sqlite3

from sparse_rl.synth.envs.base import Env, ToolError
from sparse_rl.synth.schema import tool

CITIES = ["Lisbon", "Oslo", "Quito", "Pune", "Perth", "Lagos", "Kyoto", "Lyon"]
FIRST = ["Ana", "Bo", "Cy", "Di", "Ed", "Fay", "Gus", "Hal", "Ivy", "Jo", "Kai", "Lin", "Mo", "Ned", "Oz", "Pia"]
STATUSES = ["pending", "shipped", "cancelled"]
MAX_ROWS = 50

_READ_OK = {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION, sqlite3.SQLITE_RECURSIVE}
# TRANSACTION: the sqlite3 module opens one implicitly before a data change.
_WRITE_OK = _READ_OK | {sqlite3.SQLITE_INSERT, sqlite3.SQLITE_UPDATE, sqlite3.SQLITE_DELETE, sqlite3.SQLITE_TRANSACTION}


class SqlEnv(Env):
    name = "sql"
    mutating = frozenset({"execute"})

    def __init__(self, state: dict):
        super().__init__(state)
        self.db = sqlite3.connect(":memory:", check_same_thread=False)
        for ddl in state["schema"]:
            self.db.execute(ddl)
        for table, rows in state["rows"].items():
            if rows:
                ph = ",".join("?" * len(rows[0]))
                self.db.executemany(f"INSERT INTO {table} VALUES ({ph})", rows)
        self.db.commit()
        self._allowed = _READ_OK

    def _auth(self, action, arg1, arg2, dbname, source):
        if action == sqlite3.SQLITE_FUNCTION and arg2 in ("load_extension",):
            return sqlite3.SQLITE_DENY
        return sqlite3.SQLITE_OK if action in self._allowed else sqlite3.SQLITE_DENY

    def _run(self, sql: str, allowed: set[int]):
        self._allowed = allowed
        self.db.set_authorizer(self._auth)
        try:
            cur = self.db.execute(sql)
            rows = cur.fetchmany(MAX_ROWS + 1)
            cols = [d[0] for d in cur.description] if cur.description else []
            return cur, cols, rows
        except sqlite3.Warning as e:  # e.g. "You can only execute one statement at a time."
            raise ToolError(f"SQL: {e}") from None
        except sqlite3.Error as e:
            raise ToolError(f"SQL error: {e}") from None
        finally:
            self.db.set_authorizer(None)

    @classmethod
    def tools(cls) -> list[dict]:
        return [
            tool("list_tables", "List the tables of the database.", {}),
            tool("describe_table", "Show a table's columns and types.", {"table": {"type": "string"}}),
            tool("query", "Run one read-only SQL SELECT statement; returns up to 50 rows.", {"sql": {"type": "string"}}),
            tool("execute", "Run one SQL INSERT, UPDATE or DELETE statement; returns the number of rows changed.",
                 {"sql": {"type": "string"}}),
        ]

    def tool_list_tables(self) -> str:
        rows = self.db.execute("SELECT name FROM sqlite_master WHERE type='table' ORDER BY name").fetchall()
        return "\n".join(r[0] for r in rows)

    def tool_describe_table(self, table: str) -> str:
        names = self.tool_list_tables().split("\n")
        if table not in names:
            raise ToolError(f"no table '{table}' (tables: {', '.join(names)})")
        cols = self.db.execute(f"PRAGMA table_info({table})").fetchall()
        return "\n".join(f"{c[1]} {c[2]}" for c in cols)

    def tool_query(self, sql: str) -> str:
        _, cols, rows = self._run(sql, _READ_OK)
        lines = ["\t".join(cols)] + ["\t".join("NULL" if v is None else str(v) for v in r) for r in rows[:MAX_ROWS]]
        if len(rows) > MAX_ROWS:
            lines.append(f"[more than {MAX_ROWS} rows; refine the query]")
        return "\n".join(lines)

    def tool_execute(self, sql: str) -> str:
        cur, _, _ = self._run(sql, _WRITE_OK)
        self.db.commit()
        return f"{cur.rowcount} rows changed"

    def check(self, spec: dict) -> bool:
        if spec["kind"] == "sql":
            rows = [list(r) for r in self.db.execute(spec["query"]).fetchall()]
            return rows == spec["expect"]
        raise ValueError(f"sql env: unknown check {spec['kind']!r}")

    def close(self) -> None:
        self.db.close()


# ------------------------------------------------------------------------------------- tasks

SCHEMA = ["CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT NOT NULL, city TEXT NOT NULL)",
          "CREATE TABLE orders (id INTEGER PRIMARY KEY, customer_id INTEGER NOT NULL REFERENCES customers(id), "
          "amount INTEGER NOT NULL, status TEXT NOT NULL)"]


def _make_db(rng: random.Random, level: int) -> tuple[list, list]:
    n_cust = 4 + 2 * level
    names = rng.sample(FIRST, min(n_cust, len(FIRST)))
    customers = [[i + 1, n, rng.choice(CITIES[: 3 + level // 2])] for i, n in enumerate(names)]
    orders = []
    for oid in range(1, 6 * level + 8):
        orders.append([oid, rng.randint(1, len(customers)), rng.randint(5, 500), rng.choice(STATUSES)])
    return customers, orders


def _mem(customers, orders):
    db = sqlite3.connect(":memory:")
    for ddl in SCHEMA:
        db.execute(ddl)
    db.executemany("INSERT INTO customers VALUES (?,?,?)", customers)
    db.executemany("INSERT INTO orders VALUES (?,?,?,?)", orders)
    return db


def _gen_aggregate(rng: random.Random, level: int) -> dict:
    customers, orders = _make_db(rng, level)
    city = rng.choice(sorted({c[2] for c in customers}))
    status = rng.choice(STATUSES)
    cond, extra = "", ""
    if level >= 3:
        floor = rng.randint(50, 250)
        cond, extra = f" AND o.amount > {floor}", f" counting only orders above {floor}"
    sql = (f"SELECT COALESCE(SUM(o.amount), 0) FROM orders o JOIN customers c ON c.id = o.customer_id "
           f"WHERE c.city = '{city}' AND o.status = '{status}'{cond}")
    total = _mem(customers, orders).execute(sql).fetchone()[0]
    prompt = (f"Using the shop database, what is the total amount of {status} orders placed by customers "
              f"living in {city}{extra}? Reply with the number.")
    return {"prompt": prompt, "answer": str(total), "answer_kind": "number",
            "state": {"schema": SCHEMA, "rows": {"customers": customers, "orders": orders}},
            "solution": [{"name": "list_tables", "arguments": {}}, {"name": "query", "arguments": {"sql": sql}}],
            "checks": [{"kind": "sql", "query": "SELECT COUNT(*), SUM(amount) FROM orders",
                        "expect": [[len(orders), sum(o[2] for o in orders)]]}]}


def _gen_update(rng: random.Random, level: int) -> dict:
    customers, orders = _make_db(rng, level)
    # Pick a customer with at least one pending order so the task changes state.
    cands = sorted({o[1] for o in orders if o[3] == "pending"})
    if level >= 3:  # the composed task also deletes cancelled orders: both must exist
        cands = [c for c in cands if any(o[1] == c and o[3] == "cancelled" for o in orders)]
    if not cands:
        return {}
    cid = rng.choice(cands)
    name = customers[cid - 1][1]
    stmts = [f"UPDATE orders SET status = 'shipped' WHERE status = 'pending' AND customer_id = "
             f"(SELECT id FROM customers WHERE name = '{name}')"]
    task = f"Mark every pending order of customer {name} as shipped"
    if level >= 3:
        stmts.append(f"DELETE FROM orders WHERE status = 'cancelled' AND customer_id = "
                     f"(SELECT id FROM customers WHERE name = '{name}')")
        task += ", and delete that customer's cancelled orders"
    db = _mem(customers, orders)
    changed = 0
    for s in stmts:
        changed += db.execute(s).rowcount
    final = [list(r) for r in db.execute("SELECT id, customer_id, amount, status FROM orders ORDER BY id")]
    prompt = f"{task}. Reply with the total number of rows you changed or deleted."
    return {"prompt": prompt, "answer": str(changed), "answer_kind": "number",
            "state": {"schema": SCHEMA, "rows": {"customers": customers, "orders": orders}},
            "solution": [{"name": "describe_table", "arguments": {"table": "orders"}}]
            + [{"name": "execute", "arguments": {"sql": s}} for s in stmts],
            "checks": [{"kind": "sql", "query": "SELECT id, customer_id, amount, status FROM orders ORDER BY id",
                        "expect": final}]}


TEMPLATES = {"aggregate": _gen_aggregate, "update": _gen_update}
