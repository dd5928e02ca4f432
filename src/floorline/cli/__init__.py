"""The `floorline` command: thin wrappers that parse, call the library and print.

app.py holds the typer apps and how a command ends, options.py the options and their parsers,
render.py the tables and labels, commands/ the commands by group; they are registered here, in
the order `floorline --help` lists them."""

from floorline.cli.app import app, main, models_app
from floorline.cli.commands import ab, catalogue, diagnose, engine, results, speculate, sweep

COMMANDS = (
    ("gpus", catalogue.gpus),
    ("formats", catalogue.formats),
    ("paths", catalogue.paths_cmd),
    ("floor", catalogue.floor_cmd),
    ("sweep", sweep.sweep),
    ("ab", ab.ab),
    ("probe", diagnose.probe),
    ("explain", diagnose.explain_cmd),
    ("report", results.report),
    ("predict", results.predict_cmd),
    ("show", results.show),
    ("quality", sweep.quality_cmd),
    ("speculate", speculate.speculate_cmd),
    ("merge", results.merge_cmd),
    ("generate", engine.generate_cmd),
    ("serve", engine.serve_cmd),
)
for name, command in COMMANDS:
    app.command(name)(command)
del name, command
models_app.callback()(catalogue.models)
models_app.command("fetch")(catalogue.models_fetch)

__all__ = ["app", "main"]
