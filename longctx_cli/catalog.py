"""`longctx models`, `longctx profiles` and `longctx states`: what is installed and what is saved."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from longctx_cli.errors import UsageError, clip
from longctx_cli.options import SetOpt, err, profile_from_flags

profiles_app = typer.Typer(help="List profiles, or show one's resolved settings.", invoke_without_command=True)
states_app = typer.Typer(help="List or remove saved document states ($LONGCTX_HOME/states).",
                         invoke_without_command=True)


@profiles_app.callback()
def profiles_list(ctx: typer.Context):
    """List the built-in profiles."""
    if ctx.invoked_subcommand is None:
        from longctx_cli.profiles import list_profiles

        for name, description in list_profiles():
            print(f"{name:<24} {description}")


@profiles_app.command("show")
def profiles_show(name: Annotated[str, typer.Argument(help="Profile name or YAML path.")],
                  sets: SetOpt = None):
    """Print a profile's resolved settings (defaults < profile < --set)."""
    import yaml

    class Dumper(yaml.SafeDumper):
        pass

    # Stop strings hold newlines: print them escaped ("\n\n"), not as folded multi-line scalars.
    Dumper.add_representer(str, lambda d, s: d.represent_scalar("tag:yaml.org,2002:str", s,
                                                                style='"' if "\n" in s else None))
    print(yaml.dump(profile_from_flags(name, sets).as_dict(), Dumper=Dumper, sort_keys=False), end="")


@states_app.callback()
def states_list(ctx: typer.Context):
    """List saved states, least recently used first: key, size, last use, engine, model, document."""
    if ctx.invoked_subcommand is not None:
        return
    import datetime as dt

    from longctx_cli.home import check_home
    from longctx_cli.report import gib
    from longctx_cli.states import StateStore

    check_home()
    store = StateStore()
    entries = store.entries()
    for e in entries:
        inputs = e.header.get("inputs", {})
        used = dt.datetime.fromtimestamp(e.used).strftime("%Y-%m-%d %H:%M")
        print(f"{e.key}  {gib(e.bytes):>10}  {used}  {inputs.get('engine', '?'):<12} {inputs.get('model', '?')}  "
              f"{e.header.get('meta', {}).get('document', '?')} ({inputs.get('tokens', '?')} tokens)")
    err.print(f"{len(entries)} states, {gib(sum(e.bytes for e in entries))} in {store.root}")


@states_app.command("rm")
def states_rm(keys: Annotated[Optional[list[str]], typer.Argument(help="Keys (or unique prefixes) to remove.")]
              = None,
              all_: Annotated[bool, typer.Option("--all", help="Remove every saved state.")] = False):
    """Remove saved states by key, or all of them."""
    from longctx_cli.home import check_home
    from longctx_cli.states import StateStore

    check_home()
    if not keys and not all_:
        raise UsageError("give the keys to remove (see `longctx states`) or --all")
    store = StateStore()
    known = [e.key for e in store.entries()]
    chosen = known if all_ else []
    for key in keys or []:
        matches = [k for k in known if k.startswith(key)]
        if len(matches) != 1:
            raise UsageError(f"{'no' if not matches else 'more than one'} saved state matches {clip(key)}")
        chosen += matches
    for key in chosen:
        store.remove(key)
    err.print(f"removed {len(chosen)} state{'s' * (len(chosen) != 1)}")


def models_list() -> None:
    """List the named offline models (size, layers, context, installed, converted) and the random presets."""
    from longctx_cli.gguf_convert import check_converted
    from longctx_cli.models import RANDOM_PRESETS
    from longctx_cli.named_models import EMBEDDED, NAMED, model_dir

    for m in NAMED.values():
        folder = model_dir(m)
        converted = "converted" if check_converted(folder) is None else "converted on first use (about a minute)"
        installed = "installed" if m.installed() else f"not installed: {m.install}"
        default = " (default)" if m.name == EMBEDDED else ""
        print(f"{m.name + default:<30} {m.title}; GGUF {m.gguf_bytes / 2**20:,.0f} MiB; {m.layers} layers; "
              f"{m.context:,}-token context; {m.layout} layout; {installed}; {converted}")
    for name, shape in RANDOM_PRESETS.items():
        print(f"{'random:' + name:<30} random weights of the {name} shape ({shape['num_hidden_layers']} layers, "
              f"{shape['max_position_embeddings']:,}-token context): speed runs only")
