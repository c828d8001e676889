"""reference.md, generated: every cluster.yaml field (each provider's section included) and run.yaml
field from the JSON Schemas (``infractl schema``), every command and option from the Typer app, and
the failure signatures (what infractl prints or logs → the likely cause → the runbook to follow).
One text for two readers: the handover bundle's reference.md and the repository's
docs/reference.md (``infractl reference`` writes it; tests/test_reference.py fails when the
committed one is stale).

Deterministic: the same code gives the same bytes (no time, no machine, no dict order from a
set), so a regenerated bundle is byte-identical.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from typer.core import TyperArgument, TyperGroup, TyperOption

from infractl.config import RunSpec, cluster_model

__all__ = ["FAILURE_SIGNATURES", "RUNBOOKS", "FailureSignature", "render_reference"]

#: The bundle's runbooks (runbooks/<name>), in the order the bundle lists them.
RUNBOOKS = (
    "node-failure",
    "connection-loss",
    "store-outage",
    "out-of-memory",
    "hung-job",
    "preemption",
    "full-restart",
    "rollback",
    "teardown",
)

JsonSchema = dict[str, Any]
#: Typer's click command and context: the typer pinned in constraints.txt vendors click, whose
#: classes have no public import path; what is used of them is the standard click API.
ClickCommand = Any
ClickContext = Any


@dataclass(frozen=True)
class FailureSignature:
    """One row of the failure table. ``symptom`` quotes what infractl really prints or logs
    (keep it in step with the code: tests/test_reference.py greps for each quoted event)."""

    symptom: str
    where: str
    cause: str
    runbook: str


#: Hand-kept for now: symptom → likely cause → runbook. Node-log events are the trainers' (who
#: logs which: trainer/train.py's module doc); CLI lines are what the commands print.
FAILURE_SIGNATURES: tuple[FailureSignature, ...] = (
    FailureSignature(
        "`run 'RUN' stopped at committed step N of M (agent exit codes {...}); see infractl logs ...`",
        "`infractl train` (exit 1)",
        "a node's agent gave up: the node died, or its workers failed more than `max_restarts` times",
        "node-failure",
    ),
    FailureSignature(
        "a node's log ends after its last `checkpoint_committed` with no `stopped` line",
        "`infractl logs --node NODE`",
        "the rank was killed outright: its node died or was killed (or the kernel's OOM killer, or the "
        "watchdog's SIGKILL of a hung rank)",
        "node-failure",
    ),
    FailureSignature(
        "`rank_joined` with a `world_size` below `nodes.max` × processes per node",
        "node logs",
        "the run goes on degraded, without a node that failed; `infractl rejoin NODE` brings it back",
        "node-failure",
    ),
    FailureSignature(
        "`node 'NODE' has already rejoined attempt N of run 'RUN' K time(s) (max_restarts: K)`",
        "`infractl rejoin` (exit 1)",
        "the node keeps failing: rejoining again would loop",
        "full-restart",
    ),
    FailureSignature(
        "`stopped reason=crashed` with `Timed out waiting ...ms` in its `error`",
        "node logs of the ranks that waited",
        "a peer rank stopped making progress; collectives time out at half `watchdog.step_timeout_s`",
        "hung-job",
    ),
    FailureSignature(
        "`stopped reason=crashed` with a connection error (`Connection closed by peer`, "
        "`Connection reset by peer`) while every node's processes still run",
        "node logs, `infractl status`",
        "the network between nodes dropped the collectives' connections",
        "connection-loss",
    ),
    FailureSignature(
        '`stopped error="OutOfMemoryError: ..." reason=crashed` (CUDA, or a CPU node\'s emulated device) or '
        "`error=RuntimeError: ... DefaultCPUAllocator: can't allocate memory ...` (CPU)",
        "node logs",
        "a rank ran out of device memory (`infractl plan RUN.yaml` sizes it, `--apply` changes the run to a way "
        "that fits, `--measure` checks it)",
        "out-of-memory",
    ),
    FailureSignature(
        "`store URI: ...` (e.g. `its directory does not exist (removed or unmounted?)`); the store "
        "`UNREACHABLE` in `infractl status`",
        "any command that reads the store; `infractl status`",
        "the object store is down, unmounted or refusing the credentials",
        "store-outage",
    ),
    FailureSignature(
        "`cannot follow the run's progress: store ...; training goes on`",
        "`infractl train` (foreground)",
        "the store stopped answering; the trainers keep training and retry",
        "store-outage",
    ),
    FailureSignature(
        "`checkpoint_failed` or `checkpoint_skipped` (`the previous save is still running`); `metrics_write_failed`",
        "rank 0's node log",
        "saves cannot reach the store, or it is too slow for `checkpoint.every`",
        "store-outage",
    ),
    FailureSignature(
        "`preempted`, then `stopped reason=preempted` (the signalled node) or `reason=peer_preempted`",
        "node logs",
        "a node got SIGTERM (spot reclaim, maintenance): the step was saved and committed before it left",
        "preemption",
    ),
    FailureSignature(
        "`preemption_bound` (`lower log_every or raise preemption.grace_s`)",
        "rank 0's node log",
        "a preemption notice may not be acted on within the grace period",
        "preemption",
    ),
    FailureSignature(
        "`checkpoint_invalid` (`sha256 is ..., the manifest says ...`), then `resumed` at an earlier step",
        "rank 0's node log",
        "a committed checkpoint's files changed in the store; the one before it was loaded",
        "rollback",
    ),
    FailureSignature(
        "`CheckpointError: run 'RUN': no committed checkpoint verifies (tried steps [...])`",
        "node logs (`stopped reason=crashed`)",
        "every committed checkpoint fails verification",
        "rollback",
    ),
    FailureSignature(
        "`config_changed` (`saved=... now=...`) at `resumed`",
        "rank 0's node log",
        "run.yaml fields that shape the weights changed since the checkpoint was saved",
        "rollback",
    ),
    FailureSignature(
        "`processes of cluster 'NAME' survived SIGKILL: [...]` or "
        "`terraform destroy left node directories behind in ...`",
        "`infractl teardown` (exit 1)",
        "teardown could not prove the cluster is gone",
        "teardown",
    ),
)


def render_reference(cli: ClickCommand) -> str:
    """reference.md as Markdown text: the config fields, the commands of ``cli`` (the root command
    of infractl's command line, handed over by the caller: rendering never imports the CLI), the
    failure signatures."""
    parts = [
        "# infractl reference\n",
        "Generated by `infractl reference` from infractl's config models and its command-line app: regenerate it, "
        "do not edit it.\n",
        _config_section("cluster.yaml", cluster_model().model_json_schema()),
        _config_section("run.yaml", RunSpec.model_json_schema()),
        _cli_section(cli),
        _failure_section(),
    ]
    return "\n".join(parts)


# -- config files --------------------------------------------------------------------------


def _config_section(file: str, schema: JsonSchema) -> str:
    lines = [
        f"## {file}\n",
        _cell(schema.get("description", "")) + "\n",
        "| field | type | default | constraints | meaning |",
        "|---|---|---|---|---|",
    ]
    lines += [_row(*cells) for cells in _field_rows(schema, schema.get("$defs", {}), prefix="")]
    return "\n".join(lines) + "\n"


def _field_rows(schema: JsonSchema, defs: dict[str, JsonSchema], *, prefix: str) -> Iterator[tuple[str, ...]]:
    """One row per field, depth first; a section's row comes before its fields, a mapping's row
    before the fields of each of its entries (``<name>`` standing for the entry's key). Optional
    sections (a provider's) are expanded like the others: every field of every section is listed."""
    required = set(schema.get("required", ()))
    for name, prop in schema.get("properties", {}).items():
        path = f"{prefix}{name}"
        section = _section(prop, defs)
        if section is not None:
            meaning = _joined(prop.get("description", ""), section.get("description", ""))
            yield f"`{path}`", "section", "unset" if _nullable(prop) else "", "", _cell(meaning)
            yield from _field_rows(section, defs, prefix=f"{path}.")
            continue
        yield (
            f"`{path}`",
            _type(prop, defs),
            _default(prop, name in required),
            _constraints(prop),
            _cell(prop.get("description", "")),
        )
        entries = _section(_values(prop), defs)
        if entries is not None:
            yield from _field_rows(entries, defs, prefix=f"{path}.<name>.")


def _default(prop: JsonSchema, required: bool) -> str:
    """A field's default as YAML spells it. A field that is neither required nor has a default in
    the schema has a default factory (pydantic leaves those out of the schema): an empty list or
    mapping is the only kind the models use (tests/test_reference.py holds every default to the
    model's)."""
    if "default" in prop:
        return _literal(prop["default"])
    if required:
        return "required"
    return {"array": "`[]`", "object": "`{}`"}.get(str(prop.get("type")), "")


def _joined(short: str, long: str) -> str:
    """A section's own description and its model's, once when one repeats the other."""
    if short.rstrip(".") in long:
        return long
    return f"{short} {long}".strip()


def _section(prop: JsonSchema, defs: dict[str, JsonSchema]) -> JsonSchema | None:
    """The model ``prop`` holds when it is a section: a ``$ref`` into ``$defs`` (bare, in a one-item
    ``allOf``, or beside null in an ``anyOf``: an optional section) to a schema with fields."""
    for candidate in (prop, *prop.get("allOf", ()), *_variants(prop)):
        if "$ref" in candidate:
            target = defs[str(candidate["$ref"]).removeprefix("#/$defs/")]
            return target if "properties" in target else None
    return None


def _values(prop: JsonSchema) -> JsonSchema:
    """What a mapping holds under each key (``additionalProperties``, or its one key pattern's
    schema); an empty schema for anything else."""
    values = prop.get("additionalProperties")
    if isinstance(values, dict):
        return values
    patterns = list(prop.get("patternProperties", {}).values())
    return patterns[0] if len(patterns) == 1 else {}


def _variants(prop: JsonSchema) -> list[JsonSchema]:
    """The non-null alternatives of ``prop`` (``anyOf: [X, null]`` is an optional X)."""
    return [v for v in prop.get("anyOf", [prop]) if v.get("type") != "null"]


def _nullable(prop: JsonSchema) -> bool:
    return any(v.get("type") == "null" for v in prop.get("anyOf", ()))


def _type(prop: JsonSchema, defs: dict[str, JsonSchema]) -> str:
    """The YAML type of ``prop``: a list or a mapping with what it holds (a mapping of sections
    says so), ``or null`` when it may be left unset."""
    types = [_one_type(v, defs) for v in _variants(prop)]
    return " or ".join(types) + (" or null" if _nullable(prop) else "")


def _one_type(variant: JsonSchema, defs: dict[str, JsonSchema]) -> str:
    kind = str(variant.get("type", "any"))
    if kind == "array" and "items" in variant:
        return f"list of {_one_type(variant['items'], defs)}"
    values = _values(variant)
    if kind == "object" and values:
        return "mapping of " + ("section" if _section(values, defs) is not None else _one_type(values, defs))
    return kind


def _constraints(prop: JsonSchema) -> str:
    """Ranges, lengths, patterns and allowed values, as a reader of the YAML needs them."""
    found: list[str] = []
    for variant in [prop, *prop.get("anyOf", ())]:
        low, high = variant.get("minimum"), variant.get("maximum")
        if low is not None and high is not None:
            found.append(f"{_number(low)}..{_number(high)}")
        else:
            found += [f"at least {_number(low)}"] if low is not None else []
            found += [f"at most {_number(high)}"] if high is not None else []
        found += [f"above {_number(variant['exclusiveMinimum'])}"] if "exclusiveMinimum" in variant else []
        found += [f"below {_number(variant['exclusiveMaximum'])}"] if "exclusiveMaximum" in variant else []
        found += [f"at least {variant['minLength']} characters"] if "minLength" in variant else []
        found += [f"at most {variant['maxLength']} characters"] if "maxLength" in variant else []
        found += [f"pattern `{variant['pattern']}`"] if "pattern" in variant else []
        found += _counts(variant, "Items", "items") + _counts(variant, "Properties", "entries")
        found += [f"names: pattern `{key}`" for key in variant.get("patternProperties", {})]
        if "enum" in variant:
            found.append("one of " + ", ".join(f"`{_literal_text(v)}`" for v in variant["enum"]))
        if "const" in variant:
            found.append(f"only `{_literal_text(variant['const'])}`")
    return _cell("; ".join(found))


def _counts(variant: JsonSchema, keyword: str, noun: str) -> list[str]:
    """A list's or a mapping's size bounds (``minItems``/``maxItems``, ``minProperties``/
    ``maxProperties``), e.g. ``1..8 entries``."""
    low, high = variant.get(f"min{keyword}"), variant.get(f"max{keyword}")
    if low is None and high is None:
        return []
    if low is not None and high is not None:
        return [f"{low}..{high} {noun}"]
    return [f"at least {low} {noun}"] if low is not None else [f"at most {high} {noun}"]


def _number(value: float) -> str:
    return json.dumps(value)


def _literal_text(value: object) -> str:
    """A value as it is written in YAML (strings bare); None as ``unset``."""
    if value is None:
        return "unset"
    if isinstance(value, str):
        return value or '""'
    return json.dumps(value)


def _literal(value: object) -> str:
    return "unset" if value is None else _cell(f"`{_literal_text(value)}`")


# -- the command line ------------------------------------------------------------------------


def _cli_section(root: ClickCommand) -> str:
    context = root.context_class(root, info_name="infractl")
    lines = ["## Commands\n", "Global options (before the command):\n", *_param_table(root, context), ""]
    for path, command, ctx in _commands(root, context, ("infractl",)):
        lines += [f"### `{' '.join(path)}`\n", _cell(command.help or "") + "\n"]
        if command.params:
            lines += [*_param_table(command, ctx), ""]
    return "\n".join(lines)


def _commands(
    group: ClickCommand, context: ClickContext, path: tuple[str, ...]
) -> Iterator[tuple[tuple[str, ...], ClickCommand, ClickContext]]:
    """Every visible command under ``group`` in registration order (``--help``'s), groups
    before their subcommands."""
    for name, command in group.commands.items():
        if command.hidden:
            continue
        ctx = command.context_class(command, info_name=name, parent=context)
        yield (*path, name), command, ctx
        if isinstance(command, TyperGroup):
            yield from _commands(command, ctx, (*path, name))


def _param_table(command: ClickCommand, context: ClickContext) -> list[str]:
    rows = [
        _param_row(param, context)
        for param in command.params
        if isinstance(param, (TyperOption, TyperArgument)) and not param.hidden
    ]
    return ["| argument or option | type | default | help |", "|---|---|---|---|", *rows]


def _param_row(param: TyperOption | TyperArgument, context: ClickContext) -> str:
    if isinstance(param, TyperArgument):
        names = f"`{param.metavar or (param.name or '').upper()}`"
    else:
        names = " / ".join(", ".join(f"`{o}`" for o in opts) for opts in (param.opts, param.secondary_opts) if opts)
    flag = isinstance(param, TyperOption) and param.is_flag
    kind = param.display_type(context).strip("<>")  # what --help shows: str, path, int range, a|b
    if flag:
        kind = "flag"
    elif isinstance(param, TyperOption) and param.metavar:
        kind = param.metavar
    if param.min is not None or param.max is not None:
        kind += f", {_bound(param.min)}..{_bound(param.max)}"
    if param.required:
        default = "required"
    elif flag and param.secondary_opts:
        default = f"`{param.opts[0] if param.default else param.secondary_opts[0]}`"
    elif flag:
        default = "on" if param.default else "off"
    else:
        default = "" if param.default is None else _literal(str(param.default))
    return _row(names, _cell(kind), default, _cell(param.help or ""))


def _bound(value: object) -> str:
    return "" if value is None else str(value)


# -- failures ------------------------------------------------------------------------------


def _failure_section() -> str:
    lines = [
        "## Failure signatures\n",
        "What infractl prints or logs when something goes wrong, the likely cause, and the runbook to "
        "follow (`runbooks/`). Node logs: `infractl logs --node NODE`; each rank's lifecycle events "
        "(`rank_joined`, `resumed` or `starting`, `checkpoint_staged`, `checkpoint_committed`, `stopped`) "
        "are in its own node's log.\n",
        "| symptom | where | likely cause | runbook |",
        "|---|---|---|---|",
    ]
    lines += [_row(_cell(f.symptom), _cell(f.where), _cell(f.cause), f"`{f.runbook}`") for f in FAILURE_SIGNATURES]
    return "\n".join(lines) + "\n"


# -- Markdown ------------------------------------------------------------------------------


def _cell(text: str) -> str:
    """``text`` on one line, safe inside a table cell: ``|`` escaped (GitHub's tables want it
    inside code spans too), and outside code spans ``<`` escaped, so ``<name>`` is not taken
    for an HTML tag."""
    spans = " ".join(text.replace("\b", "").split()).replace("|", "\\|").split("`")
    return "`".join(span if i % 2 else span.replace("<", "\\<") for i, span in enumerate(spans))


def _row(*cells: str) -> str:
    return "| " + " | ".join(cells) + " |"
