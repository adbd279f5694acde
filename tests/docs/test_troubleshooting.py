"""docs/operator/troubleshooting.md lists every error code the service answers, each with the
HTTP status it comes with, and nothing else. The codes are collected from the code itself: the
MeteringError subclasses (their `code` and `status`), and every other place an error's shape is
made (a status and a code written side by side: error_response, error_body, the server's own
refusals, a bound's `code=`, a table of refusals), read from the source. A new code fails this
test until the page says what it means and what to do; so does a code the page keeps after the
code dropped it. The reasons a reported event is rejected with (POST /v1/events) are checked the
same way against their schema."""

import ast
import importlib
import pkgutil
import re
import typing
from pathlib import Path

import metering
from metering.billing.schemas import EventResult
from metering.errors import MeteringError

ROOT = Path(metering.__file__).parent
PAGE = ROOT.parent / "docs" / "operator" / "troubleshooting.md"
# The simulated upstream is an app of its own: its errors are a provider's, not ours.
NOT_OURS = ("sim",)
CODE = re.compile(r"^[a-z]+(?:_[a-z0-9]+)*$")
# Tables of a status's error *type* (the error's `type` field, OpenAI's), not of codes.
TYPE_TABLES = {"ERROR_TYPES"}


def modules() -> list[Path]:
    return [
        path
        for path in sorted(ROOT.rglob("*.py"))
        if path.relative_to(ROOT).parts[0] not in NOT_OURS
    ]


def error_classes() -> dict[str, type[MeteringError]]:
    """Every MeteringError subclass, by name (every module of metering imported first)."""
    for info in pkgutil.walk_packages([str(ROOT)], "metering."):
        if info.name.split(".")[1] not in NOT_OURS and "migrations" not in info.name:
            importlib.import_module(info.name)
    found: dict[str, type[MeteringError]] = {}
    pending = [MeteringError]
    while pending:
        cls = pending.pop()
        found[cls.__name__] = cls
        pending.extend(cls.__subclasses__())
    return found


CLASSES = error_classes()


def literal(node: ast.AST | None) -> object:
    return node.value if isinstance(node, ast.Constant) else None


def is_status(value: object) -> bool:
    return type(value) is int and 400 <= value <= 599


def is_code(value: object) -> bool:
    return isinstance(value, str) and bool(CODE.match(value))


def called(node: ast.Call) -> str | None:
    func = node.func
    return func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)


def constants(tree: ast.Module) -> dict[str, tuple]:
    """A module's constants that are tuples of literals: `HEADERS_TOO_LARGE = (code, message)`."""
    found = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Tuple):
            values = tuple(literal(element) for element in node.value.elts)
            for target in node.targets:
                if isinstance(target, ast.Name):
                    found[target.id] = values
    return found


def pairs(elements: list[ast.expr], named: dict[str, tuple]) -> list[tuple[str, int]]:
    """(code, status) for each status written right before a code: `(429, "rate_limited")`,
    `error_response(400, "invalid_request", ...)`, `answer(431, *HEADERS_TOO_LARGE)`."""
    found = []
    for first, second in zip(elements, elements[1:], strict=False):
        status = literal(first)
        if not is_status(status):
            continue
        code = literal(second)
        if isinstance(second, ast.Starred) and isinstance(second.value, ast.Name):
            code = named.get(second.value.id, (None,))[0]
        if is_code(code):
            found.append((code, status))
    return found


def keyword_code(node: ast.Call) -> tuple[str, int | None] | None:
    """`SomeError(..., code="report_too_large")`, `AnswerBound(..., code=..., http_status=502)`:
    the status given beside it, else the called class's own."""
    given = {k.arg: k.value for k in node.keywords}
    code = literal(given.get("code"))
    if not is_code(code):
        return None
    status = literal(given.get("status")) or literal(given.get("http_status"))
    if status is None and called(node) in CLASSES:
        status = CLASSES[called(node)].status
    return code, status


def produced() -> dict[str, set[int]]:
    """Every error code the service can answer -> the statuses it comes with."""
    found: dict[str, set[int]] = {}

    def add(code: str, status: object) -> None:
        assert is_status(status), f"{code}: no status found beside it"
        found.setdefault(code, set()).add(status)

    for cls in CLASSES.values():
        add(cls.code, cls.status)
    for path in modules():
        tree = ast.parse(path.read_text())
        named = constants(tree)
        types = {
            id(node.value)
            for node in tree.body
            if isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id in TYPE_TABLES for t in node.targets)
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                for code, status in pairs(node.args, named):
                    add(code, status)
                if (given := keyword_code(node)) is not None:
                    add(*given)
            elif isinstance(node, ast.Tuple | ast.List):
                for code, status in pairs(node.elts, named):
                    add(code, status)
            elif isinstance(node, ast.Dict) and id(node) not in types:
                # {404: "not_found", 405: "method_not_allowed"}: a status's code.
                for key, value in zip(node.keys, node.values, strict=True):
                    if is_status(literal(key)) and is_code(literal(value)):
                        add(literal(value), literal(key))
    return found


def documented() -> dict[str, set[int]]:
    """The page's codes (a `### \\`code\\`` heading each) -> the statuses its section gives
    (`**HTTP 402**`), from the error codes' part of the page."""
    text = PAGE.read_text().split("\n## Rejected events", 1)[0]
    sections = re.split(r"^### `([a-z0-9_]+)`\n", text, flags=re.M)[1:]
    found: dict[str, set[int]] = {}
    for code, body in zip(sections[::2], sections[1::2], strict=True):
        assert code not in found, f"{code} is listed twice"
        found[code] = {int(s) for s in re.findall(r"\*\*HTTP (\d{3})\*\*", body)}
    return found


def test_the_collection_finds_each_kind_of_producer():
    """Each way of making an error is seen, so a code missing below is missing from the page."""
    codes = produced()
    assert codes["budget_exceeded"] == {402}  # a MeteringError subclass
    assert codes["report_too_large"] == {400}  # code= on InvalidRequest
    assert codes["max_response_s"] == {504}  # code= and http_status= on an answer bound
    assert codes["headers_too_large"] == {431}  # the server's own refusal, from a constant
    assert codes["method_not_allowed"] == {405}  # a status's code in a table
    assert codes["internal_error"] == {500}  # error_response(500, ...)
    assert codes["unsupported_content_encoding"] == {415}  # BodyRefused(415, ...)


def test_the_page_lists_every_code_the_service_answers_and_no_other():
    codes, page = produced(), documented()
    missing = sorted(set(codes) - set(page))
    gone = sorted(set(page) - set(codes))
    assert (missing, gone) == ([], []), (
        f"docs/operator/troubleshooting.md misses {missing} and lists {gone}, which nothing answers"
    )


def test_each_code_comes_with_the_statuses_the_page_gives():
    codes, page = produced(), documented()
    differ = {code: (page[code], codes[code]) for code in codes if page.get(code) != codes[code]}
    assert differ == {}, "code: (the page's statuses, the code's)"


def test_the_page_lists_every_reason_an_event_is_rejected_with():
    [reasons] = [
        typing.get_args(arg)
        for arg in typing.get_args(EventResult.model_fields["reason"].annotation)
        if typing.get_origin(arg) is typing.Literal
    ]
    text = PAGE.read_text().split("\n## Rejected events", 1)[1]
    listed = re.findall(r"^### `([a-z0-9_]+)`$", text, flags=re.M)
    assert sorted(listed) == sorted(reasons)
