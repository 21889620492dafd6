from longctx_cli.cli import main

main()
