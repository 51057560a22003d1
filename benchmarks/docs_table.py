"""A generated table in a docs page, between its two marker comments (the flag sweep's in
docs/flags.md, the carry-over table's in docs/reliability.md)."""


def with_table(page: str, start: str, end: str, table: str) -> str:
    """`page` with `table` between its `start` and `end` markers, in place of what was there."""
    before, _, rest = page.partition(start)
    _, _, after = rest.partition(end)
    return f"{before}{start}\n{table}\n{end}{after}"
