from longctx_cli.entry import main

main()
