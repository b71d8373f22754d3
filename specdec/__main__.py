from specdec.run import main

main()
