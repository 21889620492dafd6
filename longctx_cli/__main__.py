from longctx_cli.entry import run

run()
